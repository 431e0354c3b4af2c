"""Engine throughput and latency against transformers, on one machine, in one run.

Throughput: N chat prompts (chat template applied) of mixed length (uniform in
[min-input, max-input] tokens), ``output-len`` tokens each, greedy, EOS ignored,
all submitted at once:

* ours: ``LLMEngine`` (continuous batching, paged KV, chunked prefill);
* transformers ``generate`` with static batches, left padding, in arrival order;
* transformers ``generate_batch`` (its continuous batching), when it exists.

Same model, dtype and thread count for all three. Then TTFT and inter-token
latency percentiles of our engine at 1, 8 and 32 concurrent requests whose
arrivals are spread over time (one every ``--arrival-gap`` seconds), driven
through ``LLMEngine.step`` by an arrival schedule.

    .venv/bin/python -m bench.engine_throughput            # the full run
    .venv/bin/python -m bench.engine_throughput --quick    # a smaller one
    .venv/bin/python -m bench.engine_throughput --rounds 3 # ours and generate alternated 3x

With ``--rounds N`` ours and transformers ``generate`` alternate N times (a shared
machine's slow spells then land on both); each row is the system's median, and
each round's ratio is printed too. ``generate_batch`` runs once.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench.common import load_average, machine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads

_TEXT = (
    "the model reads every token of the conversation and answers with care while the "
    "gateway streams each piece of text to the browser so a reader sees progress at once "
    "engineers measure latency throughput memory and cost before they ship a change to "
    "production where thousands of users ask about travel cooking code history music "
    "science weather sport and the small details of their day"
)
WORDS = _TEXT.split(" ")


@dataclass
class Result:
    name: str
    seconds: float
    output_tokens: int
    prompt_tokens: int
    note: str = ""

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.seconds


def make_prompts(engine: Any, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``n`` chat prompts whose templated length is uniform in [lo, hi] tokens."""
    rng = random.Random(seed)
    tok = engine.tokenizer
    overhead = len(engine.apply_chat_template([{"role": "user", "content": "x"}])) - 1
    prompts = []
    for i in range(n):
        target = rng.randint(lo, hi)
        words = [rng.choice(WORDS) for _ in range(target * 2)]
        content = f"Question {i}: " + " ".join(words)
        ids = tok(content, add_special_tokens=False)["input_ids"][: max(1, target - overhead)]
        text = tok.decode(ids)
        prompts.append(engine.apply_chat_template([{"role": "user", "content": text}]))
    return prompts


def median_result(runs: list[Result]) -> Result:
    """One row for several runs of a system: the median time; every run in the note."""
    if len(runs) == 1:
        return runs[0]
    seconds = statistics.median(r.seconds for r in runs)
    times = " / ".join(f"{r.seconds:.1f}" for r in runs)
    note = f"median of {len(runs)} runs ({times} s); {runs[0].note}"
    return Result(runs[0].name, seconds, runs[0].output_tokens, runs[0].prompt_tokens, note)


# ------------------------------------------------------------------ our engine
def run_ours(engine: Any, prompts: list[list[int]], output_len: int) -> Result:
    from tokenrelay.engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    engine.reset_prefix_cache()
    before = engine.stats()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"tp-{i}", p, params)
    produced = 0
    while engine.has_unfinished():
        for out in engine.step():
            produced += len(out.new_token_ids)
    seconds = time.perf_counter() - start
    after = engine.stats()
    assert produced == output_len * len(prompts), produced
    steps = after["num_steps"] - before["num_steps"]
    hit = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    note = f"{steps} steps, prefix-cache hits {hit} tok"
    return Result("tokenrelay LLMEngine", seconds, produced, sum(map(len, prompts)), note)


# ---------------------------------------------------------------- transformers
def no_eos_config(model: Any, output_len: int) -> Any:
    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    config.max_new_tokens = output_len
    config.min_new_tokens = None
    config.eos_token_id = []  # keep going through EOS, like ignore_eos
    config.pad_token_id = model.config.pad_token_id or 0
    return config


def run_hf_static(model: Any, prompts: list[list[int]], output_len: int, batch_size: int) -> Result:
    import torch

    pad = model.config.pad_token_id or 0
    config = no_eos_config(model, output_len)
    produced = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(prompts), batch_size):
            batch = prompts[b : b + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(ids, attention_mask=mask, generation_config=config)
            produced += (out.shape[1] - width) * len(batch)
    seconds = time.perf_counter() - start
    assert produced == output_len * len(prompts), produced
    note = f"batches of {batch_size}, left padding"
    return Result("transformers generate", seconds, produced, sum(map(len, prompts)), note)


def run_hf_continuous(model: Any, prompts: list[list[int]], output_len: int) -> Result | None:
    if not hasattr(model, "generate_batch"):
        return None
    import torch

    config = no_eos_config(model, output_len)
    with torch.inference_mode():
        model.generate_batch(prompts[:2], generation_config=no_eos_config(model, 4))  # warm up
        start = time.perf_counter()
        outs = model.generate_batch(prompts, generation_config=config)
        seconds = time.perf_counter() - start
    produced = sum(len(o.generated_tokens) for o in outs.values())
    assert produced == output_len * len(prompts), produced
    name = "transformers generate_batch"
    return Result(name, seconds, produced, sum(map(len, prompts)), "continuous batching")


# --------------------------------------------------------------------- latency
def percentiles(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return (float("nan"),) * 3
    if len(values) == 1:
        return (values[0],) * 3
    qs = statistics.quantiles(values, n=100, method="inclusive")
    return statistics.median(values), qs[89], qs[98]


def run_latency(
    engine: Any, prompts: list[list[int]], concurrency: int, output_len: int, gap: float
) -> dict[str, Any]:
    """``concurrency`` requests, one arriving every ``gap`` seconds; TTFT and ITL."""
    from tokenrelay.engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    engine.reset_prefix_cache()
    arrivals = [i * gap for i in range(concurrency)]
    sent: dict[str, float] = {}
    last: dict[str, float] = {}
    ttft: list[float] = []
    itl: list[float] = []
    peak = 0
    start = time.perf_counter()
    nxt = 0
    while nxt < concurrency or engine.has_unfinished():
        now = time.perf_counter() - start
        while nxt < concurrency and arrivals[nxt] <= now:
            rid = f"lat-{concurrency}-{nxt}"
            engine.add_request(rid, prompts[nxt % len(prompts)], params)
            sent[rid] = start + arrivals[nxt]
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - start)))
            continue
        peak = max(peak, engine.stats()["running"])
        outs = engine.step()
        t = time.perf_counter()
        for out in outs:
            if not out.new_token_ids:
                continue
            if out.request_id not in last:
                ttft.append(t - sent[out.request_id])
            else:
                itl.extend([(t - last[out.request_id]) / len(out.new_token_ids)])
            last[out.request_id] = t
    seconds = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "peak_running": peak,
        "ttft": percentiles(ttft),
        "itl": percentiles(itl),
        "tok_s": concurrency * output_len / seconds,
    }


# ------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.engine_throughput",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="16 prompts x 32 tokens, short latency")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for every system")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--min-input", type=int, default=50)
    ap.add_argument("--max-input", type=int, default=400)
    ap.add_argument("--hf-batch-size", type=int, default=None, help="static batch size")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--latency-output-len", type=int, default=None)
    ap.add_argument("--arrival-gap", type=float, default=0.1, help="seconds between arrivals")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--skip-hf", action="store_true", help="only our engine")
    ap.add_argument(
        "--skip-hf-batch", action="store_true", help="no transformers generate_batch (slow on CPU)"
    )
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate ours and transformers generate this many times; medians compared",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    n = args.num_prompts or (16 if args.quick else 64)
    out_len = args.output_len or (32 if args.quick else 128)
    lat_len = args.latency_output_len or (16 if args.quick else 64)
    hf_bs = args.hf_batch_size or n

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenrelay.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            device=args.device,
            max_num_seqs=max(n, 32),
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    )
    threads = torch.get_num_threads()
    dtype = str(engine.runner.dtype).replace("torch.", "")
    prompts = make_prompts(engine, n, args.min_input, args.max_input, args.seed)
    lens = [len(p) for p in prompts]
    print(f"machine: {machine()}; torch {torch.__version__}, {threads} threads, {dtype}")
    print(f"load average at the start: {load_average()}")
    print(
        f"workload: {n} chat prompts, {min(lens)}..{max(lens)} tokens (mean "
        f"{statistics.mean(lens):.0f}), {out_len} output tokens each, greedy, ignore_eos"
    )
    engine.add_request("warmup", prompts[0], SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished():
        engine.step()

    ours_runs: list[Result] = []
    hf_runs: list[Result] = []
    cb: Result | None = None
    model: Any = None
    # Rounds alternate ours and transformers generate, so a slow spell of this shared
    # machine lands on both; each system's row is its median, and each round's ratio
    # compares two runs adjacent in time.
    for rnd in range(args.rounds):
        ours_runs.append(run_ours(engine, prompts, out_len))
        ours_runs[-1].note += f"; load {load_average()}"
        print(f"  ours: {ours_runs[-1].seconds:.1f}s", flush=True)
        if args.skip_hf:
            continue
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(
                str(engine.model_path), dtype=engine.runner.dtype
            )
            model = model.to(engine.runner.device).eval()
            with torch.inference_mode():  # warm up
                model.generate(
                    torch.tensor([prompts[0]]), generation_config=no_eos_config(model, 4)
                )
        hf_runs.append(run_hf_static(model, prompts, out_len, hf_bs))
        hf_runs[-1].note += f"; load {load_average()}"
        print(f"  transformers generate: {hf_runs[-1].seconds:.1f}s", flush=True)
        if rnd == 0 and not args.skip_hf_batch:
            try:
                cb = run_hf_continuous(model, prompts, out_len)
            except Exception as exc:  # report, don't die: the other rows still count
                print(f"  transformers generate_batch failed: {exc!r}")
            if cb is not None:
                cb.note += f"; load {load_average()}"
                print(f"  transformers generate_batch: {cb.seconds:.1f}s", flush=True)
    del model
    results = [median_result(ours_runs)]
    if hf_runs:
        results.append(median_result(hf_runs))
    if cb is not None:
        results.append(cb)

    ours = results[0]
    best_hf = max(results[1:], key=lambda r: r.tok_s, default=None)
    print()
    print("| system | time (s) | output tok/s | total tok/s | vs ours | notes |")
    print("|---|---:|---:|---:|---:|---|")
    for r in results:
        ratio = ours.tok_s / r.tok_s
        print(
            f"| {r.name} | {r.seconds:.1f} | {r.tok_s:.1f} | {r.total_tok_s:.1f} | "
            f"{ratio:.2f}x | {r.note} |"
        )
    if best_hf is not None:
        print(
            f"\nours / faster transformers ({best_hf.name}): **{ours.tok_s / best_hf.tok_s:.2f}x**"
            " (target >= 2.5x)"
        )
    if len(hf_runs) > 1:
        per_round = [h.seconds / o.seconds for o, h in zip(ours_runs, hf_runs, strict=False)]
        print(
            "each round, ours / transformers generate: "
            + " / ".join(f"{x:.2f}x" for x in per_round)
        )

    if not args.skip_latency:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
        print(
            f"\nlatency: {lat_len} output tokens per request, one arrival every "
            f"{args.arrival_gap:g}s, same prompt pool (ms)"
        )
        print(
            "| concurrent | peak running | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p90 "
            "| ITL p99 | tok/s |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for c in levels:
            lat = run_latency(engine, prompts, c, lat_len, args.arrival_gap)
            t, i = lat["ttft"], lat["itl"]
            print(
                f"| {c} | {lat['peak_running']} | {t[0] * 1e3:.0f} | {t[1] * 1e3:.0f} | "
                f"{t[2] * 1e3:.0f} | {i[0] * 1e3:.0f} | {i[1] * 1e3:.0f} | {i[2] * 1e3:.0f} | "
                f"{lat['tok_s']:.1f} |",
                flush=True,
            )
    print(f"\nload average at the end: {load_average()} (other processes share the CPU)")
    print(f"command: {' '.join(['python -m bench.engine_throughput', *sys.argv[1:]])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
