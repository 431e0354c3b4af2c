"""Structured outputs: our engine's tokens/s with a JSON schema against unconstrained.

The same ``batch`` chat prompts (asking for a movie review as JSON) run twice
through one ``LLMEngine``, all submitted at once, greedy, ``output-len`` tokens
each:

* unconstrained: free text, EOS ignored;
* json_schema: ``response_format`` with a schema whose ``review`` string must be
  at least 2,000 characters long, so no answer is complete (nor may take EOS)
  before ``output-len`` tokens: both runs do the same number of steps at the same
  batch size, and the difference is the guided work (the grammar matchers, the
  batch's bitmask filled on the host and applied to the logits).

One run each; the table gives tokens/s and the schema run's ratio to the
unconstrained one (the target is >= 0.8x at batch 64).

    .venv/bin/python -m bench.structured            # batch 64 x 64 tokens
    .venv/bin/python -m bench.structured --quick    # batch 8 x 16 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from bench.common import load_average, machine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads

REVIEW = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "review": {"type": "string", "minLength": 2000, "maxLength": 4000},
    },
    "required": ["title", "rating", "review"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "review", "schema": REVIEW}}
FILMS = ["a space opera", "a ghost story", "a family drama", "a silly comedy", "a western"]


def make_prompts(engine: Any, n: int) -> list[list[int]]:
    """``n`` chat prompts asking for a review as JSON."""
    return [
        engine.apply_chat_template(
            [{"role": "user", "content": f"Review {FILMS[i % len(FILMS)]} (#{i}) as JSON."}]
        )
        for i in range(n)
    ]


def run(engine: Any, prompts: list[list[int]], params: Any, tag: str) -> tuple[float, int]:
    """All ``prompts`` at once with ``params``: (seconds, tokens generated)."""
    engine.reset_prefix_cache()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    produced = 0
    while engine.has_unfinished():
        for out in engine.step():
            produced += len(out.new_token_ids)
    return time.perf_counter() - start, produced


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.structured",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="batch 8 x 16 tokens")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--batch", type=int, default=None, help="prompts at once (default 64)")
    ap.add_argument("--output-len", type=int, default=None, help="tokens each (default 64)")
    args = ap.parse_args(argv)
    n = args.batch or (8 if args.quick else 64)
    out_len = args.output_len or (16 if args.quick else 64)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenrelay.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, max_num_seqs=max(n, 8)))
    prompts = make_prompts(engine, n)
    dtype = str(engine.runner.dtype).replace("torch.", "")
    print(f"machine: {machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"load average at the start: {load_average()}")
    print(f"workload: batch {n}, {out_len} tokens each, greedy, {args.model} {dtype}")
    print(f"schema: {json.dumps(REVIEW, separators=(',', ':'))}")
    free = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    guided = SamplingParams(max_tokens=out_len, temperature=0, response_format=FORMAT)
    warm = SamplingParams(max_tokens=4, temperature=0, response_format=FORMAT)
    started = time.perf_counter()
    run(engine, prompts[:1], warm, "warmup")  # builds the grammar compiler, compiles the schema
    print(f"warm-up (grammar compiler + schema): {time.perf_counter() - started:.1f}s")
    rows = [("unconstrained", *run(engine, prompts, free, "free"))]
    rows.append(("json_schema", *run(engine, prompts, guided, "schema")))
    base = rows[0][2] / rows[0][1]
    print()
    print("| run | tokens | seconds | tok/s | vs unconstrained |")
    print("|---|---:|---:|---:|---:|")
    for name, seconds, tokens in rows:
        rate = tokens / seconds
        print(f"| {name} | {tokens} | {seconds:.2f} | {rate:.1f} | {rate / base:.2f}x |")
    print(f"\nload average at the end: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
