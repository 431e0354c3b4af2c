"""Where an engine step's time goes on a CPU, and what OpenMP's wait policy costs on a shared one.

Two measurements, one run, tables on stdout:

* ``omp``: one stream (a 231-token chat prompt, 40 tokens, greedy) stepped by
  ``LLMEngine`` in a child process with ``OMP_WAIT_POLICY=ACTIVE`` (spinning
  threads, OpenMP's usual default) and one with ``PASSIVE`` (the project
  default, engine/__init__.py), each while another process keeps one core
  busy, as the gateway and Redis do beside a worker on a laptop. Reports the
  prefill step and the median decode step, and ACTIVE / PASSIVE.
* ``decode``: the bench/engine_throughput.py workload (64 chat prompts of 50
  to 400 tokens, 128 output tokens each), every step timed, split into
  prefill steps and decode steps; then ``torch.profiler`` over five decode
  steps at the full batch, the share of the top operators.

    .venv/bin/python bench/engine_profile.py            # both
    .venv/bin/python bench/engine_profile.py omp        # one of them
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import load_average, machine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (engine/__init__.py)


def _spin(stop: Any) -> None:
    while not stop.is_set():
        sum(range(10_000))


def _single_stream() -> dict[str, float]:
    """Child side of ``omp``: step one stream, report prefill and decode step times (ms)."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="default", device="cpu"))
    ids = engine.apply_chat_template([{"role": "user", "content": "word " * 200}])
    engine.add_request("warm", ids[:32], SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished():
        engine.step()
    engine.reset_prefix_cache()
    engine.add_request("a", ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t) * 1000)
    return {"prompt": len(ids), "prefill_ms": times[0], "decode_ms": statistics.median(times[1:])}


def run_omp() -> None:
    stop = multiprocessing.Event()
    busy = multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
    busy.start()
    rows = {}
    try:
        for policy in ("ACTIVE", "PASSIVE"):
            env = dict(os.environ, OMP_WAIT_POLICY=policy)
            out = subprocess.run(
                [sys.executable, __file__, "_single"], env=env, capture_output=True, text=True
            )
            if out.returncode != 0:
                raise SystemExit(f"child with {policy} failed:\n{out.stderr[-2000:]}")
            rows[policy] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        stop.set()
        busy.join()
    a, p = rows["ACTIVE"], rows["PASSIVE"]
    print(f"\none stream, {p['prompt']}-token prompt, 40 tokens; one other core kept busy (ms)")
    print("| OMP_WAIT_POLICY | prefill step | decode step (median) |")
    print("|---|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['prefill_ms']:.0f} | {r['decode_ms']:.0f} |")
    ratio_pre, ratio_dec = a["prefill_ms"] / p["prefill_ms"], a["decode_ms"] / p["decode_ms"]
    print(f"| ACTIVE / PASSIVE | {ratio_pre:.2f}x | {ratio_dec:.2f}x |")


def run_decode(num_prompts: int, output_len: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.engine_throughput import make_prompts
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="default", device="cpu", max_num_seqs=num_prompts))
    prompts = make_prompts(engine, num_prompts, 50, 400, 0)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    engine.add_request("warm", prompts[0], SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished():
        engine.step()
    engine.reset_prefix_cache()
    for i, q in enumerate(prompts):
        engine.add_request(f"r{i}", q, params)
    prefill: list[float] = []
    decode: list[float] = []
    while engine.has_unfinished():
        running = engine.stats()["running"]
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        # a decode step: every running sequence got exactly one token and nothing waits
        if engine.stats()["waiting"] == 0 and running == len(outs) == num_prompts:
            decode.append(dt)
        else:
            prefill.append(dt)
    print(f"\n{num_prompts} prompts x {output_len} tokens, torch {torch.get_num_threads()} threads")
    print("| steps | count | seconds | ms per step |")
    print("|---|---:|---:|---:|")
    for name, xs in (("prefill (and mixed)", prefill), ("decode at full batch", decode)):
        per = sum(xs) / len(xs) * 1000 if xs else float("nan")
        print(f"| {name} | {len(xs)} | {sum(xs):.1f} | {per:.0f} |")

    for i, q in enumerate(prompts):
        engine.add_request(f"p{i}", q, SamplingParams(max_tokens=30, temperature=0))
    for _ in range(20):  # past the prefill: decode at the full batch
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"\ntorch.profiler, 5 decode steps at batch {num_prompts}: share of self CPU time")
    print("| operator | share | ms per step |")
    print("|---|---:|---:|")
    for e in events[:6]:
        share = e.self_cpu_time_total / total
        print(f"| `{e.key}` | {share:.0%} | {e.self_cpu_time_total / 5 / 1000:.0f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", nargs="?", default="both", choices=["both", "omp", "decode", "_single"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    if args.what == "_single":
        print(json.dumps(_single_stream()))
        return 0
    print(f"machine: {machine()}; load average at the start: {load_average()}")
    if args.what in ("both", "omp"):
        run_omp()
    if args.what in ("both", "decode"):
        run_decode(args.num_prompts, args.output_len)
    print(f"\nload average at the end: {load_average()}")
    print(f"command: python bench/engine_profile.py {' '.join(sys.argv[1:])}".rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
