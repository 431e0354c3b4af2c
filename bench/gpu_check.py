"""One-command GPU check of our engine against transformers on the same device (issue 18).

Needs no download: random-weight checkpoints of the SmolLM2-135M and Qwen3-0.6B
shapes are built in a temporary folder (bench/gpu_models.py) and the very same
weights serve as transformers' reference. Phases, each recorded in ``--json``
with a status (ok, failed, skipped) as soon as it ends:

- ``bandwidth``: a large device-to-device copy; bytes read + written / time;
- ``correctness_smollm2``, ``correctness_qwen3``: 8 prompts x 32 greedy tokens of
  our ``LLM`` against transformers ``generate``; in bf16 a divergence must be a
  logit tie (transformers' logits of that step put our token within a few ulps
  of its own pick). The SmolLM2-shaped engine runs 256-token steps, so its long
  prompts go through chunked prefill;
- ``latency_graphs``, ``latency_eager``: one stream's decode step time at batch 1
  with CUDA graphs and with ``enforce_eager=True``, against the weight-bandwidth
  roofline (weight bytes / measured copy bandwidth);
- ``throughput_ours``, ``throughput_transformers``: nano-vllm's benchmark (256
  requests, input and output lengths uniform in [100, 1024], random ids, greedy,
  EOS ignored, all at once) on the Qwen3 shape, ours against transformers'
  continuous batching (bench/gpu_hf.py);
- ``tensor_parallel``: where the machine has N > 1 GPUs, the Qwen3-shaped model split
  over the most of them that divide its heads (``tensor_parallel_size``, NCCL, eager):
  the correctness prompts' greedy tokens against transformers (same tie rule) and
  against TP=1's; with one GPU (or none) it is skipped and says so.

A failing phase prints its traceback on stderr and the others still run.
``--budget`` (seconds, whole run) bounds it: our throughput run gets about 45% of
what is left when it starts, transformers the rest, a run cut short is PARTIAL.
One summary table (targets: >= 10x transformers; batch-1 decode with graphs >= 50%
of the roofline) and the per-prompt divergences go to stdout, progress to stderr.
Exit status 1 when a phase failed or the tokens were not shown equal; targets only print.

Runs from a bare checkout with torch, transformers, tokenizers, safetensors, numpy,
filelock (and triton for the Triton backend); nothing is installed:

    python3 -m bench.gpu_check --json $OUT/gpu_check.json                # the GPU run
    .venv/bin/python -m bench.gpu_check --tiny --device cpu --json /tmp/g.json  # smoke

Long: the orchestration of eight phases and the one table that reports them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

T0 = time.monotonic()

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads

from bench.common import machine  # noqa: E402
from bench.gpu_engine import (  # noqa: E402
    copy_bandwidth,
    free,
    our_greedy,
    run_ours,
    runner_info,
    step_times,
)
from bench.gpu_models import (  # noqa: E402
    ModelShape,
    build_checkpoint,
    check_loadable,
    compare_greedy,
    greedy_prompts,
    hf_greedy,
    make_workload,
    shapes,
    weight_bytes,
)
from bench.gpu_report import print_report, summary_rows, throughput_ratio  # noqa: E402

PHASES = (
    "bandwidth",
    "correctness_smollm2",
    "correctness_qwen3",
    "latency_graphs",
    "throughput_ours",
    "latency_eager",
    "throughput_transformers",
    "tensor_parallel",
)
GREEDY_TOKENS = 32
GREEDY_LENS = {False: (5, 17, 64, 100, 255, 256, 513, 1000), True: (3, 5, 8, 13, 21, 34, 55, 89)}
CHUNK_TOKENS = {False: 256, True: 32}  # the SmolLM2-shaped engine's step budget: chunked prefill
LATENCY = {False: (128, 128), True: (16, 24)}  # (prompt, decode tokens) of the batch-1 run
TP_SECONDS = 60.0  # the tensor-parallel phase: N ranks load, 8 prompts, a batch-1 run
TIE_ULPS = 4.0  # a divergence within this many ulps of the top-1 logit is a tie
ENGINE_FIELDS = ("attention_backend", "enforce_eager")  # issue 18's EngineConfig fields


class Skip(Exception):
    """A phase that does not apply here (recorded as skipped, with the reason)."""


def elapsed() -> float:
    return time.monotonic() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", file=sys.stderr, flush=True)


def machine_info(device: Any) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu": machine(),
        "device": str(device),
    }
    for name in ("transformers", "triton", "flash_attn"):
        try:
            info[name] = __import__(name).__version__ if importlib.util.find_spec(name) else None
        except Exception as exc:  # installed but broken: say so, never stop here
            info[name] = f"broken: {exc!r}"
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_mem_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30)
    return info


# ------------------------------------------------------------------ the check
class GpuCheck:
    """The run's state and its phases; ``out`` is what ``--json`` holds."""

    def __init__(self, args: argparse.Namespace, device: Any, dtype: Any, tmp: Path) -> None:
        self.args, self.device, self.dtype, self.tmp = args, device, dtype, tmp
        self.cuda = device.type == "cuda"
        self.end = T0 + args.budget
        self.out: dict[str, Any] = {
            "args": vars(args),
            "machine": {},
            "phases": {p: {"status": "pending"} for p in PHASES},
            "complete": False,
        }
        self.hf: Any = None  # the Qwen3-shaped reference model
        self.folder: Path | None = None  # its checkpoint
        self.shape: ModelShape | None = None
        self.weight_bytes = 0
        self._llm: Any = None
        self._llm_error: str | None = None
        # the Qwen3-shaped correctness run: prompts, transformers' ids and logits, TP=1's ids
        self.tp_ref: tuple[list[list[int]], Any, Any, list[list[int]]] | None = None

    def left(self) -> float:
        return self.end - time.monotonic()

    def save(self) -> None:
        if self.args.json:
            path = Path(self.args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.out, indent=2, default=str) + "\n")

    def phase(
        self, name: str, fn: Callable[[], dict[str, Any]], skip: str | None = None, need: float = 0
    ) -> None:
        """Run one phase: its result, or its error, or why it was skipped, into ``out``."""
        rec = self.out["phases"][name]
        if skip is None and self.left() <= need:
            skip = f"budget: {max(self.left(), 0):.0f}s left, needs about {need:.0f}s"
        start = time.monotonic()
        if skip is not None:
            rec.update(status="skipped", reason=skip)
        else:
            log(f"{name} ...")
            try:
                rec.update(status="ok", **fn())
            except Skip as why:
                rec.update(status="skipped", reason=str(why))
            except Exception as exc:
                traceback.print_exc(file=sys.stderr)
                rec.update(status="failed", error=f"{type(exc).__name__}: {exc}")
        rec["seconds"] = round(time.monotonic() - start, 2)
        log(
            f"{name}: {rec['status']} ({rec['seconds']}s) {rec.get('reason', rec.get('error', ''))}"
        )
        self.save()

    def make_llm(self, folder: Path, *, eager: bool, **overrides: Any) -> Any:
        """Our ``LLM`` on ``folder`` with the run's backend, dtype and block size."""
        from tokenrelay.engine import LLM
        from tokenrelay.engine.config import EngineConfig

        have = {f.name for f in dataclasses.fields(EngineConfig)}
        missing = [f for f in ENGINE_FIELDS if f not in have]
        if missing:
            raise RuntimeError(
                f"engine.EngineConfig has no {', '.join(missing)}: this check needs the "
                "engine of issue 18 (attention backends, CUDA graphs)"
            )
        kw: dict[str, Any] = dict(
            dtype=str(self.dtype).replace("torch.", ""),
            attention_backend=self.args.attention_backend,
            enforce_eager=eager or not self.cuda,
            max_num_seqs=self.args.max_num_seqs,
            kv_cache_memory=None if self.cuda else 0.25,
        )
        if self.args.block_size is not None:
            kw["block_size"] = self.args.block_size
        kw.update(overrides)
        log(f"loading our engine: {kw}")
        return LLM(model=str(folder), device=str(self.device), **kw)

    def main_llm(self) -> Any:
        """The Qwen3-shaped engine (graphs on CUDA), built once; a failed build is not retried."""
        if self._llm_error is not None:
            raise RuntimeError(f"our engine failed to start: {self._llm_error}")
        if self._llm is None:
            assert self.folder is not None
            try:
                self._llm = self.make_llm(self.folder, eager=False)
            except BaseException as exc:
                self._llm_error = repr(exc)  # not the exception: its frames hold the engine
                raise
        return self._llm

    def drop_llm(self) -> None:
        self._llm = None
        free(self.device)

    # --- phases
    def bandwidth(self) -> dict[str, Any]:
        size = 2 * 2**30 if self.cuda else 64 * 2**20
        try:
            return copy_bandwidth(self.device, size)
        finally:
            free(self.device)

    def correctness(self, shape: ModelShape, main: bool) -> dict[str, Any]:
        import torch

        tiny = self.args.tiny
        folder = self.tmp / shape.key
        folder.mkdir()
        hf = build_checkpoint(folder, shape, self.args.seed, self.device, self.dtype)
        check_loadable(folder, shape)
        if main:
            self.hf, self.folder, self.shape = hf, folder, shape
            self.weight_bytes = weight_bytes(hf)
        prompts = greedy_prompts(shape, GREEDY_LENS[tiny], self.args.seed + 7)
        ref, ref_logits = hf_greedy(hf, prompts, GREEDY_TOKENS)
        del hf
        free(self.device)
        chunk = None if main else CHUNK_TOKENS[tiny]
        if main:
            llm = self.main_llm()
        else:
            llm = self.make_llm(folder, eager=False, max_num_seqs=8, max_num_batched_tokens=chunk)
        try:
            v = shape.vocab
            text = llm.tokenizer.decode([v - 2, v - 1, 5])
            if text.split() != [f"t{v - 2}", f"t{v - 1}", "t5"]:
                raise RuntimeError(f"the synthetic tokenizer decodes {text!r}")
            info = runner_info(llm)
            ours = our_greedy(llm, prompts, GREEDY_TOKENS)
        finally:
            del llm
            if not main:
                free(self.device)
        if main:
            self.tp_ref = (prompts, ref, ref_logits, ours)
        rows = compare_greedy(
            ours, ref, ref_logits, torch.finfo(self.dtype).eps, self.args.tie_ulps
        )
        for row, n in zip(rows, GREEDY_LENS[tiny], strict=True):
            row["prompt_len"] = n
        verdicts = [r["verdict"] for r in rows]
        return {
            "model": shape.label,
            "engine": info,
            "max_num_batched_tokens": chunk,
            "equal": verdicts.count("equal"),
            "ties": verdicts.count("tie"),
            "mismatches": verdicts.count("MISMATCH"),
            "passed": "MISMATCH" not in verdicts,
            "prompts": rows,
        }

    def latency(self, graphs: bool) -> dict[str, Any]:
        assert self.folder is not None and self.shape is not None
        # on the CPU the main engine is the eager one
        main = graphs or not self.cuda
        llm = self.main_llm() if main else self.make_llm(self.folder, eager=True, kv_cache_memory=4)
        info = runner_info(llm)
        if graphs and not info["graph_buckets"]:
            raise Skip(f"n/a: the engine captured no CUDA graphs ({info['attention_backend']})")
        prompt_len, tokens = LATENCY[self.args.tiny]
        rng = random.Random(self.args.seed + 11)
        warm = [rng.randrange(self.shape.vocab) for _ in range(prompt_len)]
        prompt = [rng.randrange(self.shape.vocab) for _ in range(prompt_len)]
        step_times(llm.engine, "latency-warm", warm, 8)
        decode = step_times(llm.engine, "latency", prompt, tokens)[1:]  # [0] is the prefill
        del llm
        median = statistics.median(decode)
        bw = self.out["phases"]["bandwidth"].get("gb_s")
        roof = self.weight_bytes / (bw * 1e9) if bw else None
        return {
            "engine": info,
            "prompt_len": prompt_len,
            "decode_steps": len(decode),
            "median_ms": median * 1e3,
            "p90_ms": sorted(decode)[int(0.9 * (len(decode) - 1))] * 1e3,
            "tok_s": 1 / median,
            "weight_bytes": self.weight_bytes,
            "roofline_ms": roof * 1e3 if roof else None,
            "of_roofline": roof / median if roof else None,
        }

    def workload(self) -> tuple[list[list[int]], list[int], list[list[int]]]:
        assert self.shape is not None
        a = self.args
        prompts, out_lens = make_workload(
            a.num_requests, a.min_len, a.max_len, self.shape.vocab, a.seed + 1
        )
        rng = random.Random(a.seed + 3)
        warm = [[rng.randrange(self.shape.vocab) for _ in range(a.max_len)] for _ in range(4)]
        return prompts, out_lens, warm

    def throughput_ours(self) -> dict[str, Any]:
        llm = self.main_llm()
        # the eager latency run, the table, the tensor-parallel phase
        reserve = (40 if self.cuda else 5) + 10 + self.tp_reserve()
        share = 1.0 if self.args.skip_hf_throughput else 0.45
        deadline = time.perf_counter() + max(10.0, share * (self.left() - reserve))
        prompts, out_lens, warm = self.workload()
        res = run_ours(llm.engine, prompts, out_lens, deadline, warm)
        return {
            "engine": runner_info(llm),
            "requested_output_tokens": sum(out_lens),
            **res.to_json(),
        }

    def throughput_hf(self) -> dict[str, Any]:
        from bench.gpu_hf import run_hf_cb

        # a run cut short may take up to 30 s to stop
        stop = (30 if self.cuda else 10) + self.tp_reserve()
        deadline = time.perf_counter() + max(10.0, self.left() - stop)
        prompts, out_lens, warm = self.workload()
        return run_hf_cb(self.hf, prompts, out_lens, deadline, warm).to_json()

    def tp_skip(self) -> str | None:
        """Why the tensor-parallel phase cannot run here (n/a: fewer than 2 GPUs), if so."""
        import torch

        if not self.cuda:
            return "n/a: tensor parallelism across GPUs needs CUDA devices"
        count = torch.cuda.device_count()
        if count < 2:
            return f"n/a: {count} CUDA device here; TP=N needs N > 1 GPUs"
        return None

    def tp_reserve(self) -> float:
        """Seconds the tensor-parallel phase needs at the end of the run (0 when n/a)."""
        return 0.0 if self.tp_skip() else TP_SECONDS

    def tensor_parallel(self) -> dict[str, Any]:
        import torch

        assert self.shape is not None and self.folder is not None and self.tp_ref is not None
        count, shape = torch.cuda.device_count(), self.shape
        dims = (shape.heads, shape.kv_heads, shape.intermediate)
        fits = [n for n in range(2, count + 1) if not any(d % n for d in dims)]
        if not fits:
            raise Skip(f"n/a: no size 2..{count} divides {dims} (heads, KV heads, intermediate)")
        size = max(fits)
        prompts, ref, ref_logits, tp1 = self.tp_ref
        llm = self.make_llm(
            self.folder, eager=True, tensor_parallel_size=size, max_num_seqs=8, kv_cache_memory=4
        )
        try:
            info = runner_info(llm)
            ours = our_greedy(llm, prompts, GREEDY_TOKENS)
            prompt_len, tokens = LATENCY[self.args.tiny]
            rng = random.Random(self.args.seed + 13)
            one = [rng.randrange(shape.vocab) for _ in range(prompt_len)]
            decode = step_times(llm.engine, "tp-latency", one, tokens)[1:]
        finally:
            llm.close()
            del llm
            free(self.device)
        rows = compare_greedy(
            ours, ref, ref_logits, torch.finfo(self.dtype).eps, self.args.tie_ulps
        )
        verdicts = [r["verdict"] for r in rows]
        return {
            "size": size,
            "gpus": count,
            "engine": info,
            "same_as_tp1": sum(a == b for a, b in zip(ours, tp1, strict=True)),
            "equal": verdicts.count("equal"),
            "ties": verdicts.count("tie"),
            "mismatches": verdicts.count("MISMATCH"),
            "passed": "MISMATCH" not in verdicts,
            "median_ms": statistics.median(decode) * 1e3,
            "prompts": rows,
        }

    def run(self) -> None:
        small, big = shapes(self.args.tiny)
        tiny_need = 0.1 if self.args.tiny else 1.0
        self.phase("bandwidth", self.bandwidth)
        self.phase(
            "correctness_smollm2", lambda: self.correctness(small, False), need=30 * tiny_need
        )
        self.phase("correctness_qwen3", lambda: self.correctness(big, True), need=40 * tiny_need)
        no_model = None if self.folder else "no Qwen3-shaped checkpoint (see correctness_qwen3)"
        no_graphs = None if self.cuda else "n/a: CUDA graphs need a CUDA device"
        self.phase(
            "latency_graphs", lambda: self.latency(True), no_model or no_graphs, 20 * tiny_need
        )
        self.phase("throughput_ours", self.throughput_ours, no_model, 60 * tiny_need)
        if self.cuda:
            self.drop_llm()  # the eager engine takes its place
        self.phase("latency_eager", lambda: self.latency(False), no_model, 30 * tiny_need)
        self.drop_llm()
        skip_hf = "--skip-hf-throughput" if self.args.skip_hf_throughput else None
        if self.hf is None:
            skip_hf = skip_hf or no_model
        self.phase("throughput_transformers", self.throughput_hf, skip_hf, 20 * tiny_need)
        self.hf = None
        free(self.device)
        no_tp = self.tp_skip() or (None if self.tp_ref else "no Qwen3-shaped reference run")
        self.phase("tensor_parallel", self.tensor_parallel, no_tp, TP_SECONDS * tiny_need)


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--tiny", action="store_true", help="tiny models, 16 requests of 8-32 tokens")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) or a dtype")
    ap.add_argument("--attention-backend", default=None, help="default: auto (torch on CPU)")
    ap.add_argument("--block-size", type=int, default=None, help="default: the backend's")
    ap.add_argument("--json", default=None, help="write the results here (after every phase)")
    ap.add_argument("--num-requests", type=int, default=None, help="256 (16 with --tiny)")
    ap.add_argument("--min-len", type=int, default=None, help="100 (8 with --tiny)")
    ap.add_argument("--max-len", type=int, default=None, help="1024 (32 with --tiny)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="our engine's batch limit")
    ap.add_argument("--tie-ulps", type=float, default=TIE_ULPS, help="tie tolerance, in ulps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf-throughput", action="store_true")
    args = ap.parse_args(argv)
    args.num_requests = args.num_requests or (16 if args.tiny else 256)
    args.min_len = args.min_len or (8 if args.tiny else 100)
    args.max_len = args.max_len or (32 if args.tiny else 1024)
    if args.attention_backend is None:
        args.attention_backend = "torch" if args.device == "cpu" else "auto"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --device cpu for the smoke test)", file=sys.stderr)
        return 2
    names = {"auto": None, "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    name = names.get(args.dtype, args.dtype) or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, name)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        check = GpuCheck(args, device, dtype, Path(tmp))
        check.out["args"]["dtype"] = name
        check.out["machine"] = machine_info(device)
        log(f"machine: {check.out['machine']}")
        check.run()
    rows = summary_rows(check.out, device.type == "cuda")
    check.out["ratio"] = throughput_ratio(check.out)
    check.out["summary"] = [
        dict(zip(("check", "result", "target", "verdict"), r, strict=True)) for r in rows
    ]
    print_report(check.out, rows, elapsed())
    check.out["complete"] = True
    check.out["total_s"] = round(elapsed(), 1)
    check.save()
    if args.json:
        print(f"json: {args.json}")
    ph = check.out["phases"]
    failed = [k for k, v in ph.items() if v["status"] == "failed"]
    unproven = [k for k in ("correctness_smollm2", "correctness_qwen3") if not ph[k].get("passed")]
    unproven += [k for k in ("tensor_parallel",) if ph[k].get("passed") is False]
    return 1 if failed or unproven else 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()[1:]):
        os._exit(rc)  # a transformers generation thread that ignored stop must not hang us
    raise SystemExit(rc)
