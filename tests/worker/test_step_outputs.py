"""An exception while the worker writes one stream's output ends that stream with
``error``; the step's other outputs are written as if nothing happened."""

from __future__ import annotations

from typing import Any

import pytest

from tests.worker.test_logprobs import Out, ScriptedEngine
from tokenrelay.core.wire.events import event_from_fields
from tokenrelay.core.wire.vocabulary import EventKind, FinishReason
from tokenrelay.worker.main import Worker
from tokenrelay.worker.outbox import Active
from tokenrelay.worker.store import WorkerStore


def events(a: Active) -> list[Any]:
    return [event_from_fields(i, dict(zip(f[0::2], f[1::2], strict=True)))
            for i, f in enumerate(a.events)]  # fmt: skip


@pytest.fixture
def worker_store(redis_server: Any) -> Any:
    store = WorkerStore(redis_server.url, "step-test-worker", prefix="wstep:")
    try:
        yield store
    finally:
        store.close()


def test_one_broken_output_ends_only_its_stream(
    worker_store: WorkerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def out(sid: str, text: str, n: int, done: bool) -> Out:
        return Out(sid, text, [n], done, "stop" if done else None, 2, n, None)

    script = [[out("bad", "a", 1, False), out("good", "x", 1, False)],
              [out("bad", "b", 2, True), out("good", "y", 2, True)]]  # fmt: skip
    engine = ScriptedEngine(script)
    aborted: list[str] = []
    engine.abort = lambda rid: aborted.append(rid) or True  # type: ignore[method-assign]
    worker = Worker(engine, worker_store, detach_timeout=30, stream_ttl=60)
    bad, good = (Active(s, None, "0-0", 30, 60, in_engine=True) for s in ("bad", "good"))
    worker.active.update(bad=bad, good=good)

    def broken(*args: Any, **kwargs: Any) -> list[str]:
        raise RecursionError("a tool call nested too deep")

    monkeypatch.setattr(bad, "finish_events", broken)
    while engine.has_unfinished():
        worker._step()

    got = events(bad)
    assert [e.kind for e in got] == [EventKind.TOKEN, EventKind.TOKEN, EventKind.DONE]
    assert got[-1].finish_reason == FinishReason.ERROR and "RecursionError" in got[-1].message
    assert bad.final and aborted == []  # it had finished in the engine already
    kept = events(good)
    assert [e.text for e in kept[:2]] == ["x", "y"]
    assert kept[-1].finish_reason == FinishReason.STOP
