"""Where an engine step's time goes on a CPU, and what OpenMP's wait policy costs on a shared one.

Measurements, tables on stdout:

* ``omp``: one stream (a 231-token chat prompt, 40 tokens, greedy) stepped by
  ``LLMEngine`` in child processes, one per OpenMP wait setting:
  ``OMP_WAIT_POLICY=ACTIVE`` (spinning threads), ``PASSIVE`` (the project
  default, engine/__init__.py) and ``PASSIVE`` with a short spin
  (``GOMP_SPINCOUNT``); each on an idle CPU and again while another process
  keeps one core busy, as the gateway and Redis do beside a worker on a
  laptop. Reports the prefill step and the median decode step.
* ``decode``: the bench/engine_throughput.py workload (64 chat prompts of 50
  to 400 tokens, 128 output tokens each), every step timed, split into
  prefill steps and decode steps; then ``torch.profiler`` over five decode
  steps at the full batch, the share of the top operators.
* ``attention`` (not part of ``both``): the same workload at its full decode
  batch, stepped in turn with the compiled decode kernel
  (engine/kernels/csrc/paged_attention.c) and with the torch path at several bucket
  sizes (``engine.attention.torch_sdpa.CPU_DECODE_BUCKET_ROWS``; 8 is its default), median
  wall and CPU time per step.
* ``weights`` (not part of ``both``): one chat prompt per sequence, greedy,
  ``--output-len`` tokens, at decode batches of 1, 16 and 64, stepped with
  dense fp32 weights, with the GGUF's quantized blocks (``--weights native``,
  engine/kernels/csrc/quant_matmul.c) through the PyTorch decoder op by op, and
  through the fused C decoder (engine/kernels/csrc/decoder.c, the default), in
  turn, two rounds; the median decode step of each and the speed-ups.
* ``start`` (not part of ``both``): seconds to a ready ``LLMEngine`` in a fresh
  process (torch import included) with native and with fp32 weights, first with
  an empty ``$TOKENRELAY_HOME`` (the first start: model prepared, kernels
  compiled) and then warm, and its tokenizer alone loaded by
  engine/text/tokenizer.py against ``AutoTokenizer`` (the peer), three fresh
  processes each.

    .venv/bin/python -m bench.engine_profile            # both
    .venv/bin/python -m bench.engine_profile omp        # one of them
    .venv/bin/python -m bench.engine_profile attention  # C kernel against torch buckets
    .venv/bin/python -m bench.engine_profile start      # engine and tokenizer load times
    .venv/bin/python -m bench.engine_profile weights    # quantized against fp32 weights
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.common import ROOT, load_average, machine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (engine/__init__.py)


def _spin(stop: Any) -> None:
    while not stop.is_set():
        sum(range(10_000))


def _single_stream() -> dict[str, float]:
    """Child side of ``omp``: step one stream, report prefill and decode step times (ms)."""
    from tokenrelay.engine import EngineConfig, LLMEngine, SamplingParams

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


# (OMP_WAIT_POLICY, GOMP_SPINCOUNT or None): libgomp spins that many iterations (about
# 100,000 a millisecond) before a waiting thread sleeps; PASSIVE alone means no spin.
OMP_VARIANTS = [("ACTIVE", None), ("PASSIVE", None), ("PASSIVE", "10000"), ("PASSIVE", "100000")]


def _omp_child(policy: str, spin: str | None) -> dict[str, float]:
    env = dict(os.environ, OMP_WAIT_POLICY=policy)
    env.pop("GOMP_SPINCOUNT", None)
    if spin is not None:
        env["GOMP_SPINCOUNT"] = spin
    out = subprocess.run(
        [sys.executable, "-m", "bench.engine_profile", "_single"],
        cwd=ROOT,  # the repository root, so that ``-m bench.engine_profile`` imports
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"child with {policy} / {spin} failed:\n{out.stderr[-2000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run_omp() -> None:
    """One stream's step times per OpenMP wait setting, on an idle CPU and beside a busy core."""
    rows: dict[tuple[str, str | None], dict[str, dict[str, float]]] = {v: {} for v in OMP_VARIANTS}
    for busy_core in (False, True):
        stop = multiprocessing.Event()
        busy = multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
        if busy_core:
            busy.start()
        try:
            for variant in OMP_VARIANTS:
                rows[variant]["busy" if busy_core else "idle"] = _omp_child(*variant)
        finally:
            stop.set()
            if busy_core:
                busy.join()
    prompt = int(rows[("PASSIVE", None)]["idle"]["prompt"])
    print(
        f"\none stream, {prompt}-token prompt, 40 tokens; idle CPU, then one other core kept busy"
    )
    print(
        "| OMP_WAIT_POLICY | GOMP_SPINCOUNT | prefill idle (ms) | decode idle (ms) "
        "| prefill busy (ms) | decode busy (ms) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for (policy, spin), r in rows.items():
        i, b = r["idle"], r["busy"]
        print(
            f"| {policy} | {spin or '-'} | {i['prefill_ms']:.0f} | {i['decode_ms']:.0f} "
            f"| {b['prefill_ms']:.0f} | {b['decode_ms']:.0f} |"
        )


def run_decode(num_prompts: int, output_len: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.engine_throughput import make_prompts
    from tokenrelay.engine import EngineConfig, LLMEngine, SamplingParams

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


TORCH_BUCKET_ROWS = (8, 16, 64)


def run_attention(num_prompts: int, rounds: int = 12) -> None:
    """Decode steps at the full batch: the C kernel and torch buckets of each size, interleaved."""
    import tokenrelay.engine.attention.torch_sdpa as attention
    from bench.engine_throughput import make_prompts
    from tokenrelay.engine import EngineConfig, LLMEngine, SamplingParams
    from tokenrelay.engine.attention.cpu_kernel import CpuBackend

    # dense weights: GGUF blocks served as they are attend inside the fused decoder instead
    config = EngineConfig(model="default", device="cpu", weights="fp32", max_num_seqs=num_prompts)
    engine = LLMEngine(config)
    backend = engine.runner.attention
    kernel = backend.kernel if isinstance(backend, CpuBackend) else None
    if kernel is None:
        raise SystemExit("the CPU decode kernel did not build here: see the worker's log line")
    variants: list[tuple[str, int | None]] = [("C kernel", None)]
    variants += [(f"torch, buckets of {r}", r) for r in TORCH_BUCKET_ROWS]
    prompts = make_prompts(engine, num_prompts, 50, 400, 0)
    params = SamplingParams(max_tokens=16 + rounds * len(variants), temperature=0, ignore_eos=True)
    for i, q in enumerate(prompts):
        engine.add_request(f"b{i}", q, params)
    while engine.stats()["waiting"] or engine.stats()["running"] < num_prompts:
        engine.step()
    for _ in range(3):  # every sequence past its prefill
        engine.step()
    default = attention.CPU_DECODE_BUCKET_ROWS
    wall: dict[str, list[float]] = {name: [] for name, _ in variants}
    cpu: dict[str, list[float]] = {name: [] for name, _ in variants}
    try:
        for _ in range(rounds):
            for name, rows in variants:
                backend.kernel = kernel if rows is None else None
                attention.CPU_DECODE_BUCKET_ROWS = rows or default
                t, c = time.perf_counter(), time.process_time()
                engine.step()
                wall[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
    finally:
        attention.CPU_DECODE_BUCKET_ROWS = default
        backend.kernel = kernel
    while engine.has_unfinished():
        engine.step()
    print(f"\ndecode steps at batch {num_prompts}, {rounds} steps each, interleaved")
    print("| decode attention | wall ms (median) | CPU ms (median) | wall vs the C kernel |")
    print("|---|---:|---:|---:|")
    ref = statistics.median(wall["C kernel"])
    for name, _ in variants:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f"| {name} | {w * 1000:.0f} | {c * 1000:.0f} | {w / ref:.2f}x |")


_ENGINE = "from tokenrelay.engine import EngineConfig, LLMEngine\n"
START_CHILDREN = {
    "engine, native weights (the default)": _ENGINE
    + "LLMEngine(EngineConfig(model='default', device='cpu'))",
    "engine, fp32 weights": _ENGINE
    + "LLMEngine(EngineConfig(model='default', device='cpu', weights='fp32'))",
    "tokenizer": "from tokenrelay.engine.models.store import resolve_model\n"
    "from tokenrelay.engine.text.tokenizer import load_tokenizer\n"
    "load_tokenizer(resolve_model('default'))",
    "AutoTokenizer": "from tokenrelay.engine.models.store import resolve_model\n"
    "from transformers import AutoTokenizer\n"
    "AutoTokenizer.from_pretrained(str(resolve_model('default')))",
}
FIRST_START = ("engine, native weights (the default)", "engine, fp32 weights")


def _child_seconds(name: str, code: str, env: dict[str, str] | None = None) -> float:
    timed = f"import time\nt = time.perf_counter()\n{code}\nprint(time.perf_counter() - t)"
    out = subprocess.run(
        [sys.executable, "-c", timed], cwd=ROOT, capture_output=True, text=True, env=env
    )
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def run_start(repeats: int = 3) -> None:
    """Load times in fresh processes, interleaved: the engine both ways, cold and warm
    (cold: an empty ``$TOKENRELAY_HOME``, so the model is prepared and the C kernels are
    compiled first), and the tokenizer two ways."""
    rows = {f"{name}, first start (empty home)": name for name in FIRST_START}
    seconds: dict[str, list[float]] = {label: [] for label in (*rows, *START_CHILDREN)}
    for _ in range(repeats):
        for label, name in rows.items():
            with tempfile.TemporaryDirectory(prefix="tr-home-") as home:
                env = dict(os.environ, TOKENRELAY_HOME=home)
                seconds[label].append(_child_seconds(label, START_CHILDREN[name], env))
        for name, code in START_CHILDREN.items():
            seconds[name].append(_child_seconds(name, code))
    print(f"\nseconds in a fresh process, {repeats} runs each")
    print("| load | runs (s) | median (s) |")
    print("|---|---|---:|")
    for name, xs in seconds.items():
        print(f"| {name} | {' / '.join(f'{x:.2f}' for x in xs)} | {statistics.median(xs):.2f} |")
    ratio = statistics.median(seconds["AutoTokenizer"]) / statistics.median(seconds["tokenizer"])
    print(f"AutoTokenizer / engine/text/tokenizer.py: {ratio:.1f}x")
    cold = [statistics.median(seconds[label]) for label in rows]
    print(f"first start, fp32 conversion / native: {cold[1] / cold[0]:.1f}x")


def _decode_step_ms(engine: Any, batch: int, output_len: int) -> float:
    from tokenrelay.engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"w{i}-{time.monotonic_ns()}", "Tell me a story about a dragon.", params)
    engine.step()  # the prefill
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return statistics.median(steps) * 1000


def run_weights(output_len: int, rounds: int = 2) -> None:
    from tokenrelay.engine import EngineConfig, LLMEngine

    dense = LLMEngine(EngineConfig(model="default", device="cpu", weights="fp32", max_num_seqs=64))
    native = LLMEngine(EngineConfig(model="default", device="cpu", weights="native",
                                    max_num_seqs=64))  # fmt: skip
    fused = native.runner.model.fused
    if fused is None:
        raise SystemExit("the fused decoder is off here (TOKENRELAY_FUSED_DECODER, no compiler?)")

    def native_ops(batch: int) -> float:  # the same engine with the decoder op by op
        native.runner.model.fused = None
        try:
            return _decode_step_ms(native, batch, output_len)
        finally:
            native.runner.model.fused = fused

    runs = {
        "fp32": lambda b: _decode_step_ms(dense, b, output_len),
        "native, op by op": native_ops,
        "native, fused": lambda b: _decode_step_ms(native, b, output_len),
    }
    print(f"\nmedian decode step (ms), {output_len} tokens a sequence, {rounds} rounds interleaved")
    print("| batch | fp32 (ms) | native op by op (ms) | native fused (ms) | fused vs fp32 "
          "| fused vs op by op | fused tok/s |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch in (1, 16, 64):
        ms: dict[str, list[float]] = {w: [] for w in runs}
        for _ in range(rounds):
            for w, run in runs.items():
                ms[w].append(run(batch))
        a, b, c = (statistics.median(ms[w]) for w in runs)
        print(f"| {batch} | {a:.1f} | {b:.1f} | {c:.1f} | {a / c:.2f}x | {b / c:.2f}x "
              f"| {batch / c * 1000:.1f} |")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.engine_profile",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument(
        "what",
        nargs="?",
        default="both",
        choices=["both", "omp", "decode", "attention", "start", "weights", "_single"],
    )
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
    if args.what == "attention":
        run_attention(args.num_prompts)
    if args.what == "start":
        run_start()
    if args.what == "weights":
        run_weights(args.output_len)
    print(f"\nload average at the end: {load_average()}")
    print(f"command: python -m bench.engine_profile {' '.join(sys.argv[1:])}".rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
