"""Tensor parallelism on the CPU (gloo): the default model split over 3 ranks.

SmolLM2-135M has 9 attention heads and 3 KV heads, so 3 ranks hold 3 query heads
and 1 KV head each. In fp32 the all-reduces only reorder the sums of o and down;
the greedy tokens of TP=3 must equal TP=1's. A rank that dies ends the engine's
steps with a ``TensorParallelError`` naming it, not a hang.

Slow: three processes load the model (~15 s on 2 cores) and every step makes 62
collectives between them.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest

from tests.engine.test_llm_greedy import run
from tokenrelay.engine import EngineConfig, LLMEngine, SamplingParams
from tokenrelay.engine.errors import TensorParallelError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TOKENS = 32
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tp_engine() -> Iterator[LLMEngine]:
    engine = LLMEngine(
        EngineConfig(model="default", device="cpu", weights="fp32", tensor_parallel_size=3)
    )
    yield engine
    engine.close()
    for proc in _ranks(engine):
        assert proc.poll() is not None  # close() leaves no rank behind


def _ranks(engine: LLMEngine) -> list:  # type: ignore[type-arg]
    group = engine.runner.group
    assert group is not None and group.peers is not None
    return list(group.peers.procs)  # type: ignore[attr-defined]


def _prompts(greedy_prompts: list[list[int]]) -> list[list[int]]:
    """Six of the greedy prompts: the shortest and longest raw ones, another, three chats
    (two of them long)."""
    raw = sorted(range(8), key=lambda i: len(greedy_prompts[i]))
    return [greedy_prompts[i] for i in (raw[0], raw[-1], 1, 8, 13, 15)]


def test_tp3_greedy_tokens_equal_tp1(
    tp_engine: LLMEngine, llm_engine: LLMEngine, greedy_prompts: list[list[int]]
) -> None:
    runner = tp_engine.runner
    assert runner.group is not None and runner.group.size == 3
    assert runner.kv_cache.data.shape[4] == 1  # one of the 3 KV heads per rank
    assert runner.model.cfg.num_heads == 3 and runner.graphs is None
    prompts = _prompts(greedy_prompts)
    assert max(map(len, prompts)) > 100  # a long prefill among the decodes
    llm_engine.reset_prefix_cache()
    want = run(llm_engine, prompts, GREEDY)
    got = run(tp_engine, prompts, GREEDY)
    for i, (ours, ref) in enumerate(zip(got, want, strict=True)):
        assert len(ours) == TOKENS
        assert ours == ref, f"prompt {i}: TP=3 {ours} != TP=1 {ref}"
    stats = tp_engine.stats()
    assert stats["blocks_free"] == stats["blocks_total"]


def test_a_rank_killed_mid_generation_ends_the_engine_with_a_clear_error(
    tp_engine: LLMEngine,
) -> None:
    """SIGKILL rank 2 while the engine steps: the step fails naming it; so does every later
    one; the surviving rank exits too. The module's timeout is the no-hang bound."""
    victim = _ranks(tp_engine)[1]  # rank 2
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    tp_engine.add_request("doomed", [1, 2, 3, 4, 5], params)
    tp_engine.step()  # the prefill ran on every rank
    killer = threading.Timer(0.3, os.kill, (victim.pid, signal.SIGKILL))
    killer.start()
    with pytest.raises(
        TensorParallelError, match=rf"rank 2 \(pid {victim.pid}\) died \(signal 9\)"
    ):
        while True:
            tp_engine.step()
    killer.join()
    with pytest.raises(TensorParallelError, match="the engine cannot step"):
        tp_engine.step()
    tp_engine.close()
    assert all(proc.poll() is not None for proc in _ranks(tp_engine))
