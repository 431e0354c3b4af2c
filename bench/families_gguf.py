"""Each newer model family as a Q4_K_M GGUF: tokenrelay against llama.cpp's llama-server.

For each family (llama as the baseline, granite, olmo2, phi3, gemma2, gemma3_text), a
random-weight checkpoint of about 0.7B parameters whose matrices K-quants take (hidden
1536, 24 layers, 12 query / 4 KV heads of 128, FFN 4096: every row a multiple of 256;
the default model's tokenizer) is built with bench/families.py's builder, converted to
an F16 GGUF by llama.cpp's own ``convert_hf_to_gguf.py`` (bench/gguf_convert.py; the
converters of Gemma-2 and Phi-3, which read only a SentencePiece tokenizer, are given
the converter's own BPE vocabulary path; every file's ``general.name`` is ``NAME``, free
of a family name that llama.cpp keys a tokenizer fix-up on; OLMo-2's output matrix is
untied from its embedding, as llama.cpp requires it) and quantized to ``--quant`` with
``llama-quantize``; the file is cached under ``~/.cache/tokenrelay-bench/models/`` (its
name carries the family and FORMAT; the F16 file is removed once quantized). Then
bench/vs_llamacpp.py's machinery serves it with ``tokenrelay serve`` and with
``llama-server`` in turn (the same client, stream levels, max tokens and requests per
client; KV pool matched to llama-server's context), and one summary table follows: the
file's size, ours over llama.cpp's ITL p50 (at the lowest level), throughput at each
level and peak RSS, and the decoder and weights our server used (its ``model runner
ready`` log line: tokenrelay runs at ``--log-level info`` here to log it). A file our
server refuses is reported with its error (the key or tensor), and the run goes on with
the next family. Run it on a quiet machine: llama-server's threads spin on their
barriers and slow down many times over when another process holds one of their cores.

    .venv/bin/python -m bench.families_gguf                      # every family, 1 and 8 streams
    .venv/bin/python -m bench.families_gguf --families gemma2,phi3 --streams 1,8,16
    .venv/bin/python -m bench.families_gguf --make-only          # only make the files
    .venv/bin/python -m bench.families_gguf --families llama --streams 1 --max-tokens 8 \\
        --requests-per-client 1                                  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench import families, gguf_convert, model_1b
from bench.common import load_average, load_generator_gc, machine, result_path, say, write_result
from bench.llamacpp_build import find_quantize, get_llama_server, llama_version
from bench.stream_levels import Run
from bench.vs_llamacpp import int_list, measure
from bench.vs_llamacpp_servers import OURS, PEER, Proc, start_ours, start_peer

FAMILIES = ("llama", "granite", "olmo2", "phi3", "gemma2", "gemma3_text")
FORMAT = 2  # bump when the shape or the conversion changes: the cached names change
TAG = "0.7b-k"  # the size tag of the checkpoint folders and files (with FORMAT)
NAME = f"random {TAG}"  # general.name: no family name (llama.cpp's loader reads "phi3")
SHAPE: dict[str, Any] = {
    "hidden_size": 1536,
    "num_hidden_layers": 24,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 4096,
}
# the head size Gemma scales its queries by (bench/families.py's is for its head of 72)
EXTRA: dict[str, dict[str, Any]] = {
    "gemma2": {"query_pre_attn_scalar": 128},
    "gemma3_text": {"query_pre_attn_scalar": 128},
    "olmo2": {"tie_word_embeddings": False},  # llama.cpp's OLMo-2 needs output.weight
}
QUANTS = ("Q4_K_M", "Q4_K_S", "Q6_K", "Q8_0")
K_TYPES = {"F32", "F16", "Q4_K", "Q5_K", "Q6_K", "Q8_0"}  # what our kernels multiply


# --- the files -------------------------------------------------------------------------


def model_path(family: str, quant: str) -> Path:
    return model_1b.MODELS / f"{family}-{TAG}-random-v{FORMAT}.{quant}.gguf"


def make_file(family: str, args: argparse.Namespace) -> Path:
    """The family's cached GGUF in ``args.quant``; checkpoint, conversion and quantization
    on the way when missing."""
    out = model_path(family, args.quant)
    if out.is_file():
        return out
    checkpoint = families.build(family, {**SHAPE, **EXTRA.get(family, {})}, f"{TAG}-v{FORMAT}")
    f16 = model_path(family, "F16")
    if not f16.is_file():
        gguf_convert.convert(checkpoint, f16, say, NAME)
    binary = find_quantize(args)
    say(f"quantizing {f16.name} to {args.quant} with {binary}")
    model_1b.quantize(binary, f16, out, args.quant, args.threads)
    if not args.keep_f16:
        f16.unlink()
    return out


def tensor_types(path: Path) -> Counter[str]:
    """How many tensors of each GGML type the file holds."""
    import gguf

    return Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors)


# --- our server's decoder ---------------------------------------------------------------


def runner_ready(log: str) -> dict[str, Any]:
    """The fields of the ``model runner ready`` log line (JSON or text), {} if none."""
    for line in log.splitlines():
        if "model runner ready" not in line:
            continue
        try:
            return dict(json.loads(line[line.index("{") :]))
        except ValueError:  # the text format: key=value pairs after the message
            pairs = (p.split("=", 1) for p in line.split() if "=" in p)
            return {k: v.strip("\"'") for k, v in pairs}
    return {}


def start_ours_watched(args: argparse.Namespace, gguf: Path, config, seen: dict) -> Proc:
    """``start_ours``, its log read into ``seen`` (the runner's fields) before it stops."""
    proc = start_ours(args, gguf, config)
    stop = proc.stop

    def read_then_stop() -> None:
        try:
            seen.update(runner_ready(proc.log_path.read_text(errors="replace")))
        except OSError:
            pass
        stop()

    proc.stop = read_then_stop  # type: ignore[method-assign]
    return proc


# --- the run -----------------------------------------------------------------------------


class Result:
    """One family's file and both servers' runs (or why one failed)."""

    def __init__(self, family: str, path: Path | None = None, error: str = ""):
        self.family, self.path, self.error = family, path, error
        self.runs: dict[str, Run] = {}
        self.errors: dict[str, str] = {}
        self.runner: dict[str, Any] = {}
        self.types: Counter[str] = Counter()


def first_line(e: BaseException, limit: int = 300) -> str:
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:limit]}"


def error_lines(e: BaseException) -> str:
    """The lines of a server's log tail that say what went wrong."""
    keep = [x for x in str(e).splitlines() if any(
        w in x.lower() for w in ("error", "exception", "valueerror", "keyerror", "unsupported",
                                 "missing", "tensor", "key "))]  # fmt: skip
    return "\n".join(keep[-8:]) or str(e)[-1500:]


def run_family(family: str, args: argparse.Namespace, binary: Path | None) -> Result:
    try:
        path = make_file(family, args)
    except (SystemExit, Exception) as e:  # report it, go on with the next family
        say(f"{family}: no file: {e}")
        return Result(family, error=first_line(e))
    res = Result(family, path)
    res.types = tensor_types(path)
    others = sorted(set(res.types) - K_TYPES)
    alien = f"; NOT K-quants: {', '.join(others)}" if others else ""
    say(f"== {family}: {path} ({path.stat().st_size / 2**20:.0f} MiB; tensor types "
        f"{dict(res.types)}{alien})")  # fmt: skip
    args.model = str(path)  # a file (not "default"): start_ours serves it
    servers = []
    if not args.skip_ours:
        servers.append((OURS, lambda cfg: start_ours_watched(args, path, cfg, res.runner)))
    if binary is not None:
        servers.append((PEER, lambda cfg: start_peer(args, binary, path, cfg)))
    for name, factory in servers:
        try:
            res.runs[name] = measure(name, factory, args, path, {})
        except (RuntimeError, TimeoutError, httpx.HTTPError) as e:
            res.errors[name] = first_line(e)
            say(f"{family}: {name} failed:\n{error_lines(e)}")
    if res.runner:
        say(f"  {OURS}: decoder {res.runner.get('decoder')}, weights {res.runner.get('weights')}")
    return res


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and a == a and b == b else "n/a"


def summary(results: list[Result], levels: list[int]) -> str:
    head = ["family", "file", f"ITL p50 ({levels[0]})", *(f"tok/s ({c})" for c in levels),
            "peak RSS", "our decoder", "our weights", "notes"]  # fmt: skip
    lines = [
        "| " + " | ".join(head) + " |",
        "|---|---:|" + "---:|" * (len(levels) + 2) + "---|---|---|",
    ]
    for r in results:
        size = f"{r.path.stat().st_size / 2**20:.0f} MiB" if r.path else "-"
        ours, peer = r.runs.get(OURS), r.runs.get(PEER)
        cells = []
        for i, c in enumerate([levels[0], *levels]):
            key = "itl_p50" if i == 0 else "tok_s"
            if ours and peer and c in ours.levels and c in peer.levels:
                cells.append(ratio(ours.levels[c].summary()[key], peer.levels[c].summary()[key]))
            else:
                cells.append("-")
        if ours and peer and ours.memory and peer.memory:
            cells.append(ratio(ours.memory.peak, peer.memory.peak))
        else:
            cells.append("-")
        notes = "; ".join([r.error] * bool(r.error) + [f"{k}: {v}" for k, v in r.errors.items()])
        others = sorted(set(r.types) - K_TYPES)
        if others:
            notes = "; ".join(x for x in (notes, "not K-quants: " + ", ".join(others)) if x)
        lines.append(f"| {r.family} | {size} | " + " | ".join(cells)
                     + f" | {r.runner.get('decoder', '-')} | {r.runner.get('weights', '-')} "
                     f"| {notes.replace('|', '/')} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.families_gguf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help=f"comma-separated, of {', '.join(FAMILIES)} (all)")  # fmt: skip
    ap.add_argument("--quant", default="Q4_K_M", choices=QUANTS, help="the files' type (Q4_K_M)")
    ap.add_argument("--streams", default="1,8", help="concurrency levels (1,8)")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (64)")
    ap.add_argument("--requests-per-client", type=int, default=2,
                    help="requests each client sends one after another (2)")  # fmt: skip
    ap.add_argument("--make-only", action="store_true", help="make the files and stop")
    ap.add_argument("--keep-f16", action="store_true", help="keep the F16 files")
    ap.add_argument("--skip-llamacpp", action="store_true", help="serve with tokenrelay only")
    ap.add_argument("--skip-ours", action="store_true", help="serve with llama.cpp only")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (as vs_llamacpp)")
    ap.add_argument("--rebuild", action="store_true", help="build llama-server even if cached")
    ap.add_argument("--build-jobs", type=int, default=2, help="compile jobs for a build (2)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="llama-server -t, llama-quantize threads (usable cores)")  # fmt: skip
    ap.add_argument("--llama-parallel", type=int, default=16, help="llama-server -np (16)")
    ap.add_argument("--weights", default="auto", help="tokenrelay serve --weights (auto)")
    ap.add_argument("--ready-timeout", type=float, default=900, help="server start limit (s)")
    ap.add_argument("--level-timeout", type=float, default=1800, help="one level's limit (s)")
    ap.add_argument("--request-timeout", type=float, default=600, help="httpx read timeout (s)")
    ap.add_argument("--out", nargs="?", const=str(result_path("families_gguf.md")), default=None,
                    help="also write the report here "
                    "(bench/results/families_gguf.md if no path)")  # fmt: skip
    args = ap.parse_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        ap.error(f"--families: unknown {', '.join(unknown)} (of {', '.join(FAMILIES)})")
    try:
        args.streams = int_list(args.streams)
    except ValueError:
        ap.error("--streams takes comma-separated integers")
    if not args.make_only and (not args.streams or min(args.streams) < 1):
        ap.error("--streams needs at least one positive level")
    if args.max_tokens < 1 or args.requests_per_client < 1:
        ap.error("--max-tokens and --requests-per-client must be positive")
    # what vs_llamacpp's measure() and servers read: no long prompts, a matched KV pool
    args.long_prompts, args.long_max_tokens, args.match_kv = [], 4, True
    args.log_level = "info"  # our server logs its decoder and weights at info
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    if args.make_only:
        for family in args.families:
            path = make_file(family, args)
            say(f"{path} ({path.stat().st_size / 2**20:.0f} MiB) {dict(tensor_types(path))}")
        return 0
    binary = None if args.skip_llamacpp else get_llama_server(args)
    where = machine()
    say(f"{where}; families {args.families}; {args.quant}; streams {args.streams}; "
        f"{args.max_tokens} tokens, {args.requests_per_client} request(s) per client; "
        f"load average {load_average()}")  # fmt: skip
    results = []
    with load_generator_gc():
        for family in args.families:
            results.append(run_family(family, args, binary))
    report = (
        f"## tokenrelay / llama.cpp per family ({args.quant}, CPU)\n\n"
        f"{where}; llama.cpp {llama_version(binary) if binary else 'not run'}; "
        f"{args.max_tokens} tokens per request, {args.requests_per_client} per client; "
        f"load average after {load_average()}. Ratios are tokenrelay over llama.cpp "
        "(ITL: lower is better; tok/s: higher is better).\n\n"
        + summary(results, args.streams)
        + f"\ncommand: python -m bench.families_gguf {' '.join(argv or sys.argv[1:])}\n"
    )
    print()
    print(report, flush=True)
    if args.out:
        write_result(Path(args.out), report)
    return 0 if all(not r.error and not r.errors for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
