"""gateway/ws/connection.py in process: a resume that fails half-way gives everything back.

Issue 19: an attachment taken by a resume must be released on every way out, not
only when its tail ends: here the socket goes away (the task is cancelled) while
the ``resumed`` frame waits for room in the send queue.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from tokenrelay.gateway.session import protocol as p
from tokenrelay.gateway.session.stream_session import SessionParts
from tokenrelay.gateway.streams.store import StreamStore
from tokenrelay.gateway.ws.connection import Connection
from tokenrelay.worker.store import WorkerStore


class Guard:
    """Counts the per-key stream slots a connection holds (and admits every request)."""

    def __init__(self) -> None:
        self.open = 0

    async def admit(self, principal: object, cost: int = 1) -> None:
        pass

    def open_stream(self, principal: object) -> str:
        self.open += 1
        return "bucket"

    def close_stream(self, bucket: str) -> None:
        self.open -= 1


def connection(stream_store: StreamStore, guard: Guard) -> Connection:
    parts = SessionParts(stream_store, guard, None, max_streams=8)  # type: ignore[arg-type]
    gw: Any = SimpleNamespace(settings=SimpleNamespace(send_queue=4), session_parts=parts)
    return Connection(SimpleNamespace(), gw)  # type: ignore[arg-type]


@pytest.mark.parametrize("failure", [asyncio.CancelledError, RuntimeError])
async def test_resume_failing_before_its_tail_releases_the_attachment(
    stream_store: StreamStore, worker_store: WorkerStore, failure: type[BaseException]
) -> None:
    new = await stream_store.create({"prompt": "hi", "params": {}}, "r1", attach=False)
    guard = Guard()
    conn = connection(stream_store, guard)

    async def send(frame: dict[str, Any]) -> None:
        assert frame["type"] == "resumed"
        assert len(stream_store.attachments.tracked) == 1  # attached by now
        raise failure()

    conn.send = send  # type: ignore[method-assign]
    with pytest.raises(failure):
        await conn._resume(p.Resume(new.stream_id, new.resume_token, 0))
    assert not conn.tails and not conn.slot_of and not conn.attach_of
    assert guard.open == 0, "the per-key slot was kept"
    assert conn.parts.readers.count(new.stream_id) == 0, "the seat was kept"
    assert not stream_store.attachments.tracked, "the attachment outlived the resume"
    assert await stream_store.redis.zcard(stream_store.keys.attach(new.stream_id)) == 0
