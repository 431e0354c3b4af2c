"""A worker in this process, on the session's engine, against a Redis that fills up.

Redis at its maxmemory (noeviction) refuses the worker's appends: the worker keeps
the events, waits with backoff as for an outage (one log line, no error trace, its
heartbeat kept alive) and writes them once there is room; the stream ends complete,
with no gap. tests/gateway/test_redis_full.py has the gateway's side.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.core.redis.test_connection import fill, make_room
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.events import Event
from tokenrelay.gateway.streams.store import StreamStore
from tokenrelay.worker.main import Heartbeat, Worker
from tokenrelay.worker.store import WorkerStore

PREFIX = "wfull:"
TOKENS = 64


async def _run_stream(server: EmbeddedRedis) -> tuple[list[Event], int, int]:
    """The stream's events; the last seq in Redis once it is full, and 2 s later."""
    stream_store = StreamStore(server.url, prefix=PREFIX, stream_ttl=60, admit_memory=None)
    await stream_store.start()
    client = server.client()
    try:
        for _ in range(100):  # the heartbeat thread registers the worker
            if await stream_store.live_workers(max_age=0):
                break
            await asyncio.sleep(0.05)
        params = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        new = await stream_store.create({"prompt": "Count slowly:", "params": params}, "full-rq")
        events: list[Event] = []
        at_fill = later = -1
        async for ev in stream_store.tail(new.stream_id, -1):
            events.append(ev)
            if ev.seq == 1:  # the first token
                limit = fill(client)
                await asyncio.sleep(0.5)  # appends in flight land or are refused
                at_fill = await stream_store.last_seq(new.stream_id)  # reads still work
                await asyncio.sleep(2.0)  # the heartbeat beats at least once
                later = await stream_store.last_seq(new.stream_id)
                make_room(client, limit)
        return events, at_fill, later
    finally:
        client.close()
        await stream_store.close()


def test_a_full_redis_pauses_the_worker_and_loses_nothing(
    llm_engine: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with EmbeddedRedis(tmp_path / "redis", maxmemory="8mb") as server:
        worker_store = WorkerStore(server.url, "full-test-worker", prefix=PREFIX)
        worker = Worker(llm_engine, worker_store, detach_timeout=30, stream_ttl=60)
        worker._publish_stats()
        Heartbeat(worker, server.url, PREFIX).start()
        thread = threading.Thread(target=worker.run, name="test-worker")
        thread.start()
        try:
            with caplog.at_level(logging.INFO):
                events, at_fill, later = asyncio.run(_run_stream(server))
        finally:
            worker.stop()
            thread.join(30)
            worker_store.close()
    assert not thread.is_alive()
    assert at_fill == later < TOKENS + 1, "the worker wrote while Redis was full"
    assert [ev.seq for ev in events] == list(range(TOKENS + 2))  # accepted, tokens, done
    done = events[-1]
    assert done.kind == "done" and done.finish_reason == "length", done
    assert done.completion_tokens == TOKENS
    said = [(vars(r).get("component"), r.getMessage()) for r in caplog.records]
    for component in ("worker", "heartbeat"):
        assert said.count((component, "redis is full (maxmemory): writes are refused")) == 1
        assert said.count((component, "redis takes writes again")) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "an error was logged"
