"""Which grammar engine for structured outputs: xgrammar, llguidance or outlines-core.

For each engine installed (``pip install xgrammar llguidance outlines-core``), with the
default model's tokenizer (SmolLM2, byte-level BPE, 49,152 tokens), two grammars are
compiled: ``json_object`` (any JSON object) and a realistic JSON schema
(``bench/grammar_engines.py`` ``SCHEMA``: a nested object, enums, an array of integers,
strings with ``maxLength``, optional properties). Then ``--batch`` (64) simulated
sequences walk through valid documents tokenized by the real tokenizer, so that every
matcher consumes real tokens from varied states; a sequence at the end of its document
takes EOS and starts the next one with a new matcher. Per step, timed apart:

* ``fill``: the batch's token bitmask (``[batch, ceil(V/32)]`` int32), filled by the
  engine's own batch API where it has one (xgrammar ``BatchGrammarMatcher``, llguidance
  ``LLExecutor``, both on ``--threads`` threads; outlines-core has none: one
  ``write_mask_into`` per row);
* ``accept``: every matcher advancing by its sequence's token.

Every step also checks, untimed, that each row allows its next token (and EOS exactly
at a document's end): a wrong mask shows as ``bad``. Compile times are "to the first
mask" (compile, new matcher, one mask): ``cold`` from an empty cache, ``cached`` for a
second request with the same schema (xgrammar's own compile cache; for the others the
kept grammar string or ``Index``). ``setup`` reads the tokenizer's vocabulary, once per
process.

The second table (``bench/grammar_probes.py``): for 16 probe schemas, ``--walks`` random
walks per schema through each engine's masks, and how many finished walks fail to
parse or validate (``jsonschema``). Last, the cost of applying a bitmask to
``[batch, V]`` fp32 logits on this CPU: ``tokenrelay.engine.guided``'s torch ops against
xgrammar's C++ kernel.

The schema's ``note`` has no ``maxLength``: xgrammar 0.2.9 allows no escape sequence
(``\\"``, ``\\t``...) in a string with ``maxLength``, ``minLength`` or ``pattern``, and
the timed documents must be valid for every engine.

    .venv/bin/python -m bench.grammar_choice                 # all installed engines
    .venv/bin/python -m bench.grammar_choice --steps 50 --walks 10 --engines llguidance
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import load_average, machine
from bench.grammar_engines import ENGINES, EOS, JSON_OBJECT, SCHEMA, documents
from bench.grammar_probes import PROBES, Walker, probe


# ----------------------------------------------------------------------- measuring
def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def walk(engine: Any, compiled: Any, docs: list[list[int]], batch: int, steps: int) -> dict:
    """``steps`` batched steps of ``batch`` sequences through ``docs``; per-step seconds."""
    vocab_words = (engine.vocab + 31) // 32
    bitmask = torch.full((batch, vocab_words), -1, dtype=torch.int32)
    matchers = [engine.matcher(compiled) for _ in range(batch)]
    doc_of = list(range(batch))
    pos = [i % 7 for i in range(batch)]  # staggered starts: rows in different states
    for i in range(batch):  # advance each row to its start position (untimed)
        for token in docs[doc_of[i]][: pos[i]]:
            engine.accept([matchers[i]], [token])
    next_doc = batch
    fills, accepts, bad = [], [], 0
    for _ in range(steps):
        tokens = [
            docs[doc_of[i]][pos[i]] if pos[i] < len(docs[doc_of[i]]) else EOS for i in range(batch)
        ]
        t0 = time.perf_counter()
        engine.fill(matchers, bitmask)
        t1 = time.perf_counter()
        for i, token in enumerate(tokens):  # untimed: the mask allows the right tokens
            at_end = token == EOS
            if not allowed(bitmask, i, token) or (not at_end and allowed(bitmask, i, EOS)):
                bad += 1
        t2 = time.perf_counter()
        ok = engine.accept(matchers, tokens)
        t3 = time.perf_counter()
        bad += sum(1 for x in ok if not x)
        fills.append(t1 - t0)
        accepts.append(t3 - t2)
        for i, token in enumerate(tokens):  # a finished row starts the next document
            pos[i] += 1
            if token == EOS:
                doc_of[i], next_doc = next_doc % len(docs), next_doc + 1
                pos[i] = 0
                matchers[i] = engine.matcher(compiled)
    return {"fill": fills, "accept": accepts, "bad": bad}


def first_mask(engine: Any, compiled: Any) -> None:
    bitmask = torch.full((1, (engine.vocab + 31) // 32), -1, dtype=torch.int32)
    engine.fill([engine.matcher(compiled)], bitmask)


def compile_times(engine: Any, schema: dict[str, Any], reps: int) -> tuple[float, float, Any]:
    """Median seconds to the first mask, cold and cached; and the compiled grammar."""
    colds: list[float] = []
    while len(colds) < reps and sum(colds) < 5.0:  # one run of a very slow compile
        t0 = time.perf_counter()
        compiled = engine.cold(schema)
        first_mask(engine, compiled)
        colds.append(time.perf_counter() - t0)
    engine.cached(schema, compiled)  # fills the engine's own cache, if it has one
    cached: list[float] = []
    for _ in range(max(reps, 5)):
        t0 = time.perf_counter()
        first_mask(engine, engine.cached(schema, compiled))
        cached.append(time.perf_counter() - t0)
    return statistics.median(colds), statistics.median(cached), compiled


def apply_costs(batch: int, vocab: int, reps: int = 50) -> list[tuple[str, list[float]]]:
    """Median ms to apply a random bitmask to ``[batch, vocab]`` fp32 logits on the CPU,
    with 1 torch thread and with torch's default (the 2-core machine is often busy, and
    two threads then wait for each other)."""
    from tokenrelay.engine.guided.bitmask import apply_bitmask

    logits = torch.randn(batch, vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32)
    rows: list[tuple[str, Callable[[], object]]] = [
        ("engine.guided apply_bitmask (torch ops)", lambda: apply_bitmask(logits, bitmask))
    ]
    try:
        import xgrammar as xgr

        rows.append(
            ("xgrammar apply_token_bitmask_inplace (C++)",
             lambda: xgr.apply_token_bitmask_inplace(logits, bitmask))
        )  # fmt: skip
    except ImportError:
        pass
    default = torch.get_num_threads()
    out = []
    for name, fn in rows:
        medians = []
        for threads in thread_counts(default):
            torch.set_num_threads(threads)
            fn()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            medians.append(statistics.median(times) * 1e3)
        torch.set_num_threads(default)
        out.append((name, medians))
    return out


def thread_counts(default: int) -> list[int]:
    """1, and torch's default thread count."""
    return sorted({1, default})


def load(name: str, tokenizer: Any, vocab: int, threads: int) -> tuple[Any, float] | None:
    """The engine's adapter and its setup seconds (imports untimed), or None if missing."""
    try:  # llguidance.torch compiles a kernel with torch.compile at import: not setup
        for module in ENGINES[name].modules:
            importlib.import_module(module)
    except ImportError as exc:
        print(f"| {name} | not installed ({exc}) |")
        return None
    t0 = time.perf_counter()
    engine = ENGINES[name](tokenizer, vocab, threads)
    return engine, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per grammar")
    parser.add_argument("--compile-reps", type=int, default=3)
    parser.add_argument("--walks", type=int, default=40, help="random walks per probe (0: none)")
    parser.add_argument(
        "--threads", type=int, default=len(os.sched_getaffinity(0)), help="for batch APIs"
    )
    args = parser.parse_args()
    from tokenrelay.engine.models.store import resolve_model
    from tokenrelay.engine.text.tokenizer import load_tokenizer

    folder = resolve_model("default")
    tokenizer = load_tokenizer(folder)
    vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    kinds = {"json_object": JSON_OBJECT, "schema": SCHEMA}
    docs = {k: documents("schema" if k == "schema" else "object", tokenizer, 256, 1) for k in kinds}
    print(f"# {machine()}, load {load_average()}; batch {args.batch}, {args.steps} steps,")
    print(f"# {args.threads} threads for batch APIs; vocab {vocab}; median ms")
    print(
        "| engine | grammar | setup s | compile cold ms | compile cached ms "
        "| fill ms/step | accept ms/step | fill+accept p90 | bad |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    loaded = {}
    for name in args.engines:
        got = load(name, tokenizer, vocab, args.threads)
        if got is None:
            continue
        engine, setup = loaded[name] = got
        for kind, schema in kinds.items():
            cold, cached, compiled = compile_times(engine, schema, args.compile_reps)
            res = walk(engine, compiled, docs[kind], args.batch, args.steps)
            total = sorted(f + a for f, a in zip(res["fill"], res["accept"], strict=True))
            p90 = total[int(0.9 * (len(total) - 1))]
            print(
                f"| {name} | {kind} | {setup:.2f} | {cold * 1e3:.1f} | {cached * 1e3:.2f} "
                f"| {statistics.median(res['fill']) * 1e3:.3f} "
                f"| {statistics.median(res['accept']) * 1e3:.3f} | {p90 * 1e3:.3f} "
                f"| {res['bad']} |",
                flush=True,
            )
    if args.walks > 0:
        print(f"\n# {len(PROBES)} probe schemas, {args.walks} random walks each")
        print("| engine | refused schemas | walks ended | invalid outputs | first invalid |")
        print("|---|---|---:|---:|---|")
        walker = Walker(tokenizer, vocab)
        for name, (engine, _) in loaded.items():
            res = probe(engine, walker, args.walks)
            refused = "; ".join(f"{p} ({why})" for p, why in res["refused"]) or "none"
            bad = res["invalid"]
            kinds_bad = sorted({p for p, _, _ in bad})
            first = f"{bad[0][0]}: {bad[0][1]!r} ({bad[0][2]})" if bad else ""
            print(
                f"| {name} | {refused} | {res['ended']}/{res['walks']} "
                f"| {len(bad)} in {', '.join(kinds_bad) or 'none'} | {first} |",
                flush=True,
            )
    counts = thread_counts(torch.get_num_threads())
    print(f"\n# applying a bitmask to [{args.batch}, {vocab}] fp32 logits, median ms")
    print("| | " + " | ".join(f"{n} torch thread{'s' if n > 1 else ''}" for n in counts) + " |")
    print("|---|" + "---:|" * len(counts))
    for label, ms in apply_costs(args.batch, vocab):
        print(f"| {label} | " + " | ".join(f"{x:.3f}" for x in ms) + " |")


if __name__ == "__main__":
    main()
