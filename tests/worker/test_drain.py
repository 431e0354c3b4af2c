"""A worker in this process, on the session's engine and Redis: drain past its timeout.

A stream that cannot finish within the drain timeout ends with ``error`` and a
message saying so, with its summary line; the worker then leaves (heartbeat gone).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest

from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.events import Event
from tokenrelay.gateway.streams.store import StreamStore
from tokenrelay.worker.main import Heartbeat, Worker
from tokenrelay.worker.store import WorkerStore

PREFIX = "wdrain:"


async def _run_stream(url: str, worker: Worker) -> list[Event]:
    stream_store = StreamStore(url, prefix=PREFIX, stream_ttl=60)
    await stream_store.start()
    try:
        for _ in range(100):  # the heartbeat thread registers the worker
            if await stream_store.live_workers(max_age=0):
                break
            await asyncio.sleep(0.05)
        body = {"prompt": "Count slowly:", "params": {"max_tokens": 500, "ignore_eos": True}}
        new = await stream_store.create(body, "drain-rq", attach=False)
        events: list[Event] = []
        async for ev in stream_store.tail(new.stream_id, -1):
            events.append(ev)
            if ev.kind == "token" and len([e for e in events if e.kind == "token"]) == 2:
                worker.drain(0.3)  # far too short for 500 tokens
        return events
    finally:
        await stream_store.close()


def test_drain_timeout_ends_the_stream_with_a_clear_error(
    llm_engine: Any, redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    url = redis_server.url
    worker_store = WorkerStore(url, "drain-test-worker", prefix=PREFIX)
    worker = Worker(llm_engine, worker_store, detach_timeout=30, stream_ttl=60)
    worker._publish_stats()
    Heartbeat(worker, url, PREFIX).start()
    thread = threading.Thread(target=worker.run, name="test-worker")
    thread.start()
    try:
        with caplog.at_level(logging.INFO):
            events = asyncio.run(_run_stream(url, worker))
            thread.join(30)
    finally:
        worker.stop()
        thread.join(30)
        while llm_engine.has_unfinished():  # let the engine process the abort
            llm_engine.step()
        worker_store.close()
    assert not thread.is_alive()
    done = events[-1]
    assert done.kind == "done" and done.finish_reason == "error", done
    assert done.message is not None and "(drain timeout)" in done.message
    assert done.completion_tokens == len([e for e in events if e.kind == "token"]) >= 2
    summaries = [r for r in caplog.records if r.getMessage() == "stream summary"]
    assert len(summaries) == 1 and vars(summaries[0])["request_id"] == "drain-rq"
    assert vars(summaries[0])["finish_reason"] == "error"
    assert not redis_server.client().exists(f"{PREFIX}w:drain-test-worker")
