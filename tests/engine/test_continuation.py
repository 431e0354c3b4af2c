"""A request continued from the tokens it already produced (``add_request(generated=...)``,
what a worker does after taking over a dead worker's stream) goes on exactly as the
uninterrupted run: greedy and seeded tokens, stop strings, max_tokens, the grammar."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.engine.test_llm_engine import drain, ids_of, text_of
from tokenrelay.engine import EngineConfig, LLMEngine, SamplingParams
from tokenrelay.engine.runner import sampler
from tokenrelay.engine.runner.sampler import row_uniform

TOKENS = 24
CUTS = (1, 7, 16)  # tokens produced before the "worker died"
NEAR_TIE = 1e-3  # logprob gap of the top two under which a greedy choice may flip
LOGIT_NOISE = 2e-3  # how far a continuation's logits may round from the uninterrupted run's
SAMPLE = sampler._sample_filtered  # the top-k/top-p sampler itself, before any recording


@pytest.fixture(scope="module")
def native() -> Iterator[LLMEngine]:
    """The default model as served: the GGUF's blocks through the fused C decoder."""
    engine = LLMEngine(EngineConfig(model="default", device="cpu"))
    yield engine
    assert not engine.has_unfinished()


def knife_edge(probs: torch.Tensor, u: float, sel: SamplingParams) -> bool:
    """Whether a draw ``u`` from one row of ``probs`` (as the sampler saw them) chooses on
    a knife edge: whether the sampler picks another token for logits moved by at most
    ``LOGIT_NOISE`` (random moves, seeded: the same verdict every run)."""
    gen = torch.Generator().manual_seed(0)
    row = probs[None, :].double()
    draw = torch.tensor([u], dtype=torch.float64)
    chosen = SAMPLE(row, [sel], draw)
    for _ in range(64):
        moved = row * torch.exp((torch.rand(row.shape, generator=gen) * 2 - 1) * LOGIT_NOISE)
        if not torch.equal(SAMPLE(moved / moved.sum(), [sel], draw), chosen):
            return True
    return False


@pytest.fixture
def draws(monkeypatch: pytest.MonkeyPatch) -> dict[float, torch.Tensor]:
    """Each top-p row's probabilities, by its uniform draw, as the sampler samples them."""
    seen: dict[float, torch.Tensor] = {}

    def record(probs: torch.Tensor, sel: Any, u: torch.Tensor) -> torch.Tensor:
        for row, draw in enumerate(u.tolist()):
            seen.setdefault(draw, probs[row].clone())
        return SAMPLE(probs, sel, u)

    monkeypatch.setattr(sampler, "_sample_filtered", record)
    return seen


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams, generated: list[int],
        rid: str) -> Any:  # fmt: skip
    engine.add_request(rid, prompt, params, generated=generated)
    return drain(engine)[rid]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=TOKENS, temperature=0, frequency_penalty=0.8,
                       repetition_penalty=1.2, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=TOKENS, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True,
                       logprobs=2),
    ],
    ids=["greedy", "penalized", "seeded"],
)  # fmt: skip
def test_continuation_gives_the_uninterrupted_tokens(
    native: LLMEngine,
    greedy_prompts: list[list[int]],
    params: SamplingParams,
    draws: dict[float, torch.Tensor],
) -> None:
    """Equal tokens; a run may part only where the uninterrupted one chose on a knife edge:
    a near tie of its top two (greedy), a draw near the edge of its choice (seeded). The
    continued tokens are prefilled, where they were decoded one by one: the logits round
    differently (~1e-4; the float16 KV cache's rounding can make it ~1e-3)."""
    for p, prompt in enumerate(greedy_prompts[:3] + greedy_prompts[9:10]):
        draws.clear()
        whole = run(native, prompt, params, [], f"whole{p}")
        mine = dict(draws)  # the uninterrupted run's rows alone
        ids = ids_of(whole)
        assert len(ids) == TOKENS and whole[-1].completion_tokens == TOKENS
        for cut in CUTS:
            # a batch around it, as a worker would have: its tokens must not move
            native.add_request(f"other{p}{cut}", greedy_prompts[5], params)
            rest = run(native, prompt, params, ids[:cut], f"cont{p}{cut}")
            drain(native)
            got = ids[:cut] + ids_of(rest)
            if got != ids and params.temperature == 0:
                at = next(i for i, (a, b) in enumerate(zip(got, ids, strict=True)) if a != b)
                top = whole[at].new_logprobs[0].top  # type: ignore[index]
                gap = top[0].logprob - top[1].logprob
                assert gap < NEAR_TIE, (p, cut, at, gap)
                continue
            if got != ids and params.seed is not None:
                at = next(i for i, (a, b) in enumerate(zip(got, ids, strict=True)) if a != b)
                u = float(torch.tensor(row_uniform(params.seed, at), dtype=torch.float32))
                assert knife_edge(mine[u], u, params), (p, cut, at)
                continue
            assert got == ids, (p, cut)
            assert rest[-1].completion_tokens == TOKENS  # each token counted once
            assert rest[-1].finish_reason == "length"


def test_continuation_keeps_the_held_back_text_and_stop_strings(
    native: LLMEngine, greedy_prompts: list[list[int]]
) -> None:
    """The text after the cut is the uninterrupted run's text after the same tokens, and a
    stop string that straddles the cut still ends the answer and never shows."""
    prompt = greedy_prompts[0]
    free = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    whole = run(native, prompt, free, [], "w")
    ids, text = ids_of(whole), text_of(whole)
    stop = text[len(text) // 2 : len(text) // 2 + 4]  # in the middle of the answer
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, stop=[stop])
    stopped = run(native, prompt, params, [], "s")
    want = text_of(stopped)
    n = len(ids_of(stopped))
    assert stop not in want and stopped[-1].finish_reason == "stop"
    for cut in range(1, n):
        shown = text_of(run(native, prompt, params, [], f"s{cut}")[:cut])  # as streamed
        rest = run(native, prompt, params, ids[:cut], f"c{cut}")
        assert shown + text_of(rest) == want, cut
        assert rest[-1].finish_reason == "stop"


def test_bad_generated_tokens_are_refused(
    native: LLMEngine, greedy_prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_tokens=4, temperature=0)
    for bad in ([10**9], [-1], [1, 2, 3, 4]):  # outside the vocabulary; no room left
        with pytest.raises(ValueError, match="generated"):
            native.add_request("bad", greedy_prompts[0], params, generated=bad)
    assert not native.has_unfinished()
