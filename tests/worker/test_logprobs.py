"""The worker puts each token's logprobs on the token event that carries its text."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.worker.test_stats import IdleEngine
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.events import event_from_fields
from tokenrelay.core.wire.logprobs import Logprobs, TokenLogprob, decode_logprobs
from tokenrelay.worker.main import Worker
from tokenrelay.worker.outbox import Active
from tokenrelay.worker.store import WorkerStore


@dataclass
class Out:
    request_id: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    new_logprobs: list[Logprobs] | None


def lp(token: str, value: float) -> Logprobs:
    return Logprobs(TokenLogprob(token, value, token.encode()))


class ScriptedEngine(IdleEngine):
    """Each step returns the next list of outputs."""

    def __init__(self, script: list[list[Out]]) -> None:
        super().__init__()
        self.script = script

    def has_unfinished(self) -> bool:
        return bool(self.script)

    def step(self) -> list[Any]:
        return self.script.pop(0)


@pytest.fixture
def worker_store(redis_server: EmbeddedRedis) -> Iterator[WorkerStore]:
    store = WorkerStore(redis_server.url, "lp-test-worker", prefix="wlp:")
    try:
        yield store
    finally:
        store.close()


def run(worker_store: WorkerStore, script: list[list[Out]]) -> list[Any]:
    worker = Worker(ScriptedEngine(script), worker_store, detach_timeout=30, stream_ttl=60)
    a = Active("s", None, "0-0", 30, 60, in_engine=True)
    worker.active["s"] = a
    while worker.engine.has_unfinished():
        worker._step()
    return [event_from_fields(i, dict(zip(f[0::2], f[1::2], strict=True))) for i, f in
            enumerate(a.events)]  # fmt: skip


def test_held_back_tokens_go_with_the_next_text_and_eos_with_none(
    worker_store: WorkerStore,
) -> None:
    a, b, c = lp("Hel", -0.1), lp("\ufffd", -0.2), lp("lo", -0.3)
    script = [
        [Out("s", "Hel", [1], False, None, 3, 1, [a])],
        [Out("s", "", [2], False, None, 3, 2, [b])],  # an incomplete character: no text yet
        [Out("s", "\u201clo", [3], False, None, 3, 3, [c])],
        [Out("s", "", [0], True, "stop", 3, 4, None)],  # EOS: no logprob, no text
    ]
    events = run(worker_store, script)
    assert [e.kind for e in events] == ["token", "token", "done"]
    assert decode_logprobs(events[0].logprobs) == (0, [a])
    assert decode_logprobs(events[1].logprobs) == (3, [b, c])  # offset: after "Hel"
    assert events[2].logprobs is None


def test_no_field_when_not_asked(worker_store: WorkerStore) -> None:
    script = [
        [Out("s", "Hi", [1], False, None, 3, 1, None)],
        [Out("s", "!", [2], True, "length", 3, 2, None)],
    ]
    events = run(worker_store, script)
    assert [e.logprobs for e in events] == [None, None, None]
