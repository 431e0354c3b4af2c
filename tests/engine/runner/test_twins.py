"""Identical prefill chunks in one step are computed once (engine/runner/twins.py).

The plan is pure logic, tested exactly; then the real default model (native weights)
shows that twins get the same tokens and logprobs while the step computes one chunk for
them all.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tokenrelay.engine import EngineConfig, LLMEngine, SamplingParams
from tokenrelay.engine.runner.step import StepInput
from tokenrelay.engine.runner.twins import plan_twins

BS = 4


def test_equal_chunks_over_the_same_blocks_are_twins() -> None:
    step = StepInput(
        token_ids=[[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [1, 2], [5, 6, 7, 8, 9]],
        starts=[4, 4, 0, 4],
        block_tables=[[0, 1, 2], [0, 3, 4], [5], [0, 6, 7]],
        sampling=[0, 1, 2, 3],
    )
    plan = plan_twins(step, BS)
    assert plan is not None
    assert plan.reduced.token_ids == [[5, 6, 7, 8, 9], [1, 2]]
    assert plan.reduced.starts == [4, 0] and plan.reduced.block_tables == [[0, 1, 2], [5]]
    assert plan.reduced.sampling == [0, 1]
    assert plan.rows == [0, 0, 1, 0]
    # positions 4..8 are blocks 1 and 2 of each: the source's, into each twin's
    assert list(zip(plan.src_blocks, plan.dst_blocks, strict=True)) == [
        (1, 3),
        (2, 4),
        (1, 6),
        (2, 7),
    ]


@pytest.mark.parametrize(
    "step",
    [
        # different context blocks before the chunk
        StepInput([[5, 6], [5, 6]], [4, 4], [[0, 1], [2, 3]], [0, 1]),
        # the chunk starts inside a block
        StepInput([[5, 6], [5, 6]], [3, 3], [[0, 1], [0, 2]], [0, 1]),
        # different positions or tokens
        StepInput([[5, 6], [5, 6]], [0, 4], [[0, 1], [2, 3]], [0, 1]),
        StepInput([[5, 6], [5, 7]], [0, 0], [[0], [1]], [0, 1]),
    ],
)
def test_no_twins(step: StepInput) -> None:
    assert plan_twins(step, BS) is None


def test_a_twin_that_samples_gets_its_sources_logits() -> None:
    """The source's chunk is not its prompt's last, the twin's is: the source's last row
    still gets logits, and they go to the twin only."""
    step = StepInput([[1, 2, 3], [1, 2, 3], [9, 9]], [0, 0, 0], [[0], [1], [2]], [1, 2])
    plan = plan_twins(step, BS)
    assert plan is not None and plan.reduced.sampling == [0, 1] and plan.rows == [0, 1]
    logits = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert torch.equal(plan.expand(logits), logits)
    assert plan.src_blocks == [0] and plan.dst_blocks == [1]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="default", device="cpu", weights="native"))


SAME = (
    "Write a short story about a lighthouse keeper and a comet. Keep it to three lines, "
    "give the keeper a name, and end on the comet's tail over the sea."
)
OTHER = "List three uses of a paperclip."


def _run(engine: LLMEngine, prompts: list[str], tokens: int = 12) -> list[list[Any]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    ids = [f"t{i}-{id(prompts)}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    out: dict[str, list[Any]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(zip(o.new_token_ids, o.new_logprobs or [], strict=True))
    return [out[rid] for rid in ids]


def _spy(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The chunk lengths of each forward the runner runs from now on."""
    forward = engine.runner.forward
    chunks: list[list[int]] = []

    def spy(step: StepInput) -> Any:
        chunks.append([len(t) for t in step.token_ids])
        return forward(step)

    monkeypatch.setattr(engine.runner, "forward", spy)
    return chunks


def test_same_prompts_at_once_compute_their_tail_once(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = len(engine.tokenizer(SAME)["input_ids"])
    assert n > 16 and n % 16, n  # full blocks and a partial one
    _run(engine, [SAME])  # its full blocks now in the prefix cache
    alone = _run(engine, [SAME])[0]  # the partial block computed alone over them
    chunks = _spy(engine, monkeypatch)
    together = _run(engine, [SAME, OTHER, SAME, SAME])
    other_n = len(engine.tokenizer(OTHER)["input_ids"])
    assert chunks[0] == [n % 16, other_n]  # one tail for three requests
    assert together[0] == together[2] == together[3]  # logprobs included
    # alone its tail ran in another batch: the default file's prefill products may round
    # differently with the batch (the K-quant kernels never do), greedy tokens do not
    assert [t for t, _ in together[0]] == [t for t, _ in alone]
    assert all(len(t) == 12 for t in together)


def test_a_new_prompt_sent_three_times(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = "Tell it again, for a second comet on another night, in a storm. " + SAME
    n = len(engine.tokenizer(prompt)["input_ids"])
    assert n > 16 and n % 16, n
    chunks = _spy(engine, monkeypatch)
    together = _run(engine, [prompt] * 3)
    monkeypatch.undo()
    # the first computes it all; the others wait for its full blocks, fork them, and
    # compute the partial one: once, beside the first's decode
    assert chunks[:2] == [[n], [1, n % 16]]
    assert together[1] == together[2]
    assert [t for t, _ in together[0]] == [t for t, _ in together[1]]
