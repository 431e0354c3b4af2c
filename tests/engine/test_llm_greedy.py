"""Greedy output of our engine, token for token against transformers' ``generate``."""

from __future__ import annotations

import pytest

from tests.engine.conftest import GREEDY_TOKENS
from tokenrelay.engine import EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Add every prompt at once and step until all finish; token ids per prompt."""
    ids = [f"greedy-{id(prompts)}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason == "length"
    return [tokens[rid] for rid in ids]


def test_greedy_matches_transformers_all_batched(
    llm_engine: LLMEngine, greedy_prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    lengths = sorted(len(p) for p in greedy_prompts)
    assert lengths[0] < 20 and lengths[-1] > 150  # mixed prompt lengths in one batch
    llm_engine.reset_prefix_cache()  # a real batched prefill, not cache hits
    got = run(llm_engine, greedy_prompts, GREEDY)
    for i, (ours, ref) in enumerate(zip(got, hf_greedy, strict=True)):
        assert ours == ref, f"prompt {i} diverges at {_first_diff(ours, ref)}"


def test_greedy_matches_transformers_one_at_a_time(
    llm_engine: LLMEngine, greedy_prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    """Alone in the batch: the shortest and longest raw prompts and two chat turns.

    The batched test above covers all 16; each prompt alone costs ~5 s on 2 cores.
    """
    llm_engine.reset_prefix_cache()
    by_len = sorted(range(8), key=lambda i: len(greedy_prompts[i]))
    for i in (by_len[0], by_len[-1], 8, 15):
        prompt, ref = greedy_prompts[i], hf_greedy[i]
        (ours,) = run(llm_engine, [prompt], GREEDY)
        assert ours == ref, f"prompt {i} diverges at {_first_diff(ours, ref)}"


@pytest.fixture(scope="module")
def small_engine() -> LLMEngine:
    """A pool of 40 blocks x 16 = 640 token slots: the batch needs ~100 blocks at once."""
    return LLMEngine(
        EngineConfig(
            model="default",
            device="cpu",
            weights="fp32",
            num_blocks=40,
            max_num_batched_tokens=256,
        )
    )


def test_preemption_keeps_every_output_identical(
    small_engine: LLMEngine, greedy_prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    fits = [i for i, p in enumerate(greedy_prompts) if len(p) + GREEDY_TOKENS <= 240]
    assert len(fits) >= 12
    need = sum(-(-(len(greedy_prompts[i]) + GREEDY_TOKENS) // 16) for i in fits)
    assert need > 2 * small_engine.stats()["blocks_total"]
    got = run(small_engine, [greedy_prompts[i] for i in fits], GREEDY)
    stats = small_engine.stats()
    assert stats["preemptions"] > 0
    for i, ours in zip(fits, got, strict=True):
        assert ours == hf_greedy[i], f"prompt {i} diverges at {_first_diff(ours, hf_greedy[i])}"
    assert stats["blocks_free"] == stats["blocks_total"]
    assert stats["running"] == stats["waiting"] == 0


def test_context_limit_ends_with_length(small_engine: LLMEngine) -> None:
    assert small_engine.max_model_len == 640  # capped at the pool
    prompt = list(range(1000, 1630))
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    assert small_engine.add_request("ctx", prompt, params) == 630
    outs = []
    while small_engine.has_unfinished():
        outs.extend(small_engine.step())
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert outs[-1].completion_tokens == 10  # 630 + 10 fills the 640-token context
    with pytest.raises(ValueError, match="prompt"):
        small_engine.add_request("too-long", list(range(1000, 1640)), SamplingParams())


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
