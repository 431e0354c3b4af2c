"""Tensor parallelism of the families beyond Llama on the CPU (gloo): 2 ranks against 1.

Each family's tiny random checkpoint comes from its own test module (4 query heads and
2 KV heads, so each rank holds 2 and 1): Granite (its four scalars; biases on every
projection, the o and down ones added once after the all-reduce), Gemma 2 (soft-capped
scores and logits, a sliding window), Gemma 3 (per-head q/k norms, local layers with
their own RoPE), OLMo 2 (q/k norms over the whole projections: one all-reduce of the sums
of squares per layer), and Phi-3 (a checkpoint with q/k/v and gate/up fused, cut section
by section; partial rotary with a sliding window, and longrope). In fp32 the reductions
only reorder sums: TP=2's greedy tokens must equal TP=1's, and both transformers' (but at
a top-2 tie).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.engine.models import test_families, test_gemma, test_phi3
from tests.engine.models.test_families import Reference, prompts, run
from tokenrelay.engine import EngineConfig, LLMEngine

__all__ = ["prompts"]  # the shared prompts fixture (five prompts, 5 to 93 tokens)

pytestmark = pytest.mark.timeout(120)

BUILDERS: dict[str, Callable[[str, Path, Path], Any]] = {
    "granite-bias": test_families.build_checkpoint,
    "gemma2": test_gemma.build_checkpoint,
    "gemma3": test_gemma.build_checkpoint,
    "olmo2": test_families.build_checkpoint,
    "phi3": test_phi3.build_phi3,
    "phi3-longrope": test_phi3.build_phi3,
}


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_two_ranks_give_one_ranks_greedy_tokens(
    kind: str, tmp_path: Path, model_path: Path, prompts: list[list[int]]
) -> None:
    hf = BUILDERS[kind](kind, tmp_path, model_path)
    if kind == "phi3-longrope":  # the engine's long factors: transformers' past 32 tokens
        prompts = [p for p in prompts if len(p) > test_phi3.ORIGINAL]
    refs = [Reference(hf, p) for p in prompts]
    config = dict(model=str(tmp_path), device="cpu", weights="fp32", num_blocks=64)
    one = LLMEngine(EngineConfig(**config))
    want = run(one, prompts)
    one.close()
    two = LLMEngine(EngineConfig(**config, tensor_parallel_size=2))
    try:
        runner = two.runner
        assert runner.group is not None and runner.group.size == 2
        assert runner.model.cfg.num_heads == 2 and runner.model.cfg.num_kv_heads == 1
        got = run(two, prompts)
    finally:
        two.close()
    for i, (ours, ref) in enumerate(zip(got, want, strict=True)):
        assert ours == ref, f"{kind} prompt {i}: TP=2 {ours} != TP=1 {ref}"
        refs[i].check(ours, f"{kind} prompt {i} TP=2")
