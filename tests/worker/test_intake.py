"""A worker in this process, on the session's engine and Redis: requests while tokenized.

A long prompt is tokenized on the preparer's thread while the loop goes on; these
tests hold that thread (a gate in front of the real encoder) to catch the stream
in between: cancelled there, it ends as one cancelled before it ran; handed back
by a drain, it is queued again for another worker; let through, it runs with the
same prompt tokens as the engine's own tokenizing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.events import Event
from tokenrelay.gateway.streams.store import StreamStore
from tokenrelay.worker.main import Heartbeat, Worker
from tokenrelay.worker.prepare import INLINE_CHARS, Preparer
from tokenrelay.worker.store import WorkerStore

PREFIX = "wintake:"
LONG_PROMPT = "Tell me about the sea. " * (INLINE_CHARS // 20)  # > INLINE_CHARS: the thread


class Gated:
    """The worker's real encoder behind a gate the test opens."""

    def __init__(self, encode: Callable[[dict[str, Any]], list[int]]) -> None:
        self.encode = encode
        self.gate = threading.Event()
        self.entered = threading.Event()

    def __call__(self, body: dict[str, Any]) -> list[int]:
        self.entered.set()
        assert self.gate.wait(30)
        return self.encode(body)


@pytest.fixture
def running(llm_engine: Any, redis_server: EmbeddedRedis) -> Iterator[tuple[Worker, Gated]]:
    worker_store = WorkerStore(redis_server.url, "intake-test-worker", prefix=PREFIX)
    worker = Worker(llm_engine, worker_store, detach_timeout=30, stream_ttl=60)
    gated = Gated(worker.intake.encode)
    worker.intake.preparer = Preparer(gated)
    worker._publish_stats()
    Heartbeat(worker, redis_server.url, PREFIX).start()
    thread = threading.Thread(target=worker.run, name="test-worker")
    thread.start()
    try:
        yield worker, gated
    finally:
        gated.gate.set()
        worker.stop()
        thread.join(30)
        while llm_engine.has_unfinished():  # let the engine process any abort
            llm_engine.step()
        worker_store.close()


async def _store(url: str) -> StreamStore:
    stream_store = StreamStore(url, prefix=PREFIX, stream_ttl=60)
    await stream_store.start()
    for _ in range(100):  # the heartbeat thread registers the worker
        if await stream_store.live_workers(max_age=0):
            return stream_store
        await asyncio.sleep(0.05)
    raise AssertionError("the worker never registered")


async def _events(stream_store: StreamStore, sid: str) -> list[Event]:
    return [ev async for ev in stream_store.tail(sid, -1)]


def _wait(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_long_prompt_runs_with_the_engines_own_token_count(
    running: tuple[Worker, Gated], llm_engine: Any, redis_server: EmbeddedRedis
) -> None:
    _, gated = running
    gated.gate.set()

    async def go() -> list[Event]:
        stream_store = await _store(redis_server.url)
        try:
            body = {"prompt": LONG_PROMPT, "params": {"max_tokens": 3, "temperature": 0}}
            new = await stream_store.create(body, "intake-long", attach=False)
            return await _events(stream_store, new.stream_id)
        finally:
            await stream_store.close()

    events = asyncio.run(go())
    assert gated.entered.is_set()  # it went through the thread
    assert events[0].kind == "accepted"
    assert events[0].prompt_tokens == len(llm_engine.encode(LONG_PROMPT))
    assert events[-1].kind == "done" and events[-1].finish_reason == "length"


def test_a_stream_cancelled_while_tokenized_ends_as_cancelled_before_it_ran(
    running: tuple[Worker, Gated], llm_engine: Any, redis_server: EmbeddedRedis
) -> None:
    worker, gated = running

    async def go() -> list[Event]:
        stream_store = await _store(redis_server.url)
        try:
            body = {"prompt": LONG_PROMPT, "params": {"max_tokens": 50}}
            new = await stream_store.create(body, "intake-cancel", attach=False)
            await asyncio.to_thread(gated.entered.wait, 30)
            await stream_store.cancel(new.stream_id)
            sid = new.stream_id
            await asyncio.to_thread(_wait, lambda: worker.active[sid].abort_reason == "cancelled")
            gated.gate.set()
            return await _events(stream_store, sid)
        finally:
            await stream_store.close()

    events = asyncio.run(go())
    assert [e.kind for e in events] == ["rejected", "done"], events
    assert events[0].code == "cancelled" and events[1].finish_reason == "cancelled"
    # the gateway ends a stream still queued itself; the worker's own ending of it is then
    # refused as a write and it drops the stream: either way the engine never sees it
    _wait(lambda: not worker.active)
    assert not llm_engine.has_unfinished()


def test_a_drain_hands_a_stream_being_tokenized_back_to_the_queue(
    running: tuple[Worker, Gated], redis_server: EmbeddedRedis
) -> None:
    worker, gated = running

    async def go() -> str:
        stream_store = await _store(redis_server.url)
        try:
            body = {"prompt": LONG_PROMPT, "params": {"max_tokens": 50}}
            new = await stream_store.create(body, "intake-drain", attach=False)
            await asyncio.to_thread(gated.entered.wait, 30)
            worker.drain(5.0)
            await asyncio.to_thread(_wait, lambda: not worker.active)
            gated.gate.set()
            info = await stream_store.info(new.stream_id)
            assert info is not None
            return info.status
        finally:
            await stream_store.close()

    assert asyncio.run(go()) == "queued"
    assert not worker.intake.preparing
