"""Backpressure through a real gateway process: a client that stops reading.

The token source here is the real :class:`WorkerStore` writing events as fast as
Redis takes them (the way the load-test tools in bench/ do), so the test needs
no model. A stalled client must not grow the gateway's memory, must not slow
another client's stream, and must still get every event once it reads again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.procs import Client, Proc, start_gateway, wait_ready
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.events import accepted_fields, done_fields, token_fields
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.gateway.streams.store import NewStream, StreamStore
from tokenrelay.worker.store import Batch, WorkerStore

EVENTS = 6000
TEXT = "x" * 1000  # 1 kB per event: 6 MB per stream, far more than socket buffers


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture
async def bp_gateway(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> AsyncIterator[tuple[Proc, str, StreamStore, WorkerStore]]:
    prefix = "bp:"
    gw, addr = start_gateway(redis_server.url, prefix, tmp_path)
    stream_store = StreamStore(redis_server.url, prefix=prefix)
    worker_store = WorkerStore(redis_server.url, "bp-source", prefix=prefix)
    worker_store.ensure_group()
    worker_store.heartbeat(WorkerStats())
    await stream_store.start()
    try:
        wait_ready(addr, gw, 60, need_worker=False)
        yield gw, addr, stream_store, worker_store
    finally:
        await stream_store.close()
        worker_store.close()
        gw.stop()


def resume(new: NewStream) -> dict[str, Any]:
    return {"type": "resume", "stream_id": new.stream_id, "resume_token": new.resume_token}


def produce(worker_store: WorkerStore, sid: str, entry: str) -> None:
    worker_store.flush([Batch(sid, 0, [accepted_fields(1, "bp-source")], {"st": "running"})])
    seq = 1
    while seq < EVENTS:
        n = min(200, EVENTS - seq)
        res = worker_store.flush([Batch(sid, seq, [token_fields(TEXT)] * n)])
        assert res[0].status == 1
        seq += n
        worker_store.heartbeat(WorkerStats())
    done = done_fields("length", 1, EVENTS - 1)
    assert (
        worker_store.flush([Batch(sid, EVENTS, [done], {"fr": "length"}, 60, entry)])[0].status == 1
    )


async def test_stalled_client_is_bounded_and_slows_no_one(bp_gateway) -> None:  # type: ignore[no-untyped-def]
    gw, addr, stream_store, worker_store = bp_gateway
    slow_new = await stream_store.create({"prompt": "a", "params": {}}, "slow", attach=False)
    fast_new = await stream_store.create({"prompt": "b", "params": {}}, "fast", attach=False)
    reqs = {r.stream_id: r.entry_id for r in worker_store.read_requests(10, None)}

    slow = await Client.open(addr, max_queue=4)
    await slow.send(resume(slow_new))
    assert (await slow.recv())["type"] == "resumed"
    before = rss_kib(gw.pid)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(
        None, produce, worker_store, slow_new.stream_id, reqs[slow_new.stream_id]
    )
    await asyncio.sleep(1.0)  # the gateway has had every chance to buffer the slow stream
    grown = rss_kib(gw.pid) - before
    assert grown < 40_000, f"gateway grew by {grown} KiB for a stalled client"

    # meanwhile another client streams at full speed
    fast = await Client.open(addr)
    await fast.send(resume(fast_new))
    started = time.monotonic()
    producer = loop.run_in_executor(
        None, produce, worker_store, fast_new.stream_id, reqs[fast_new.stream_id]
    )
    frames = await fast.recv_until(lambda f: f["type"] == "done", 60)
    await producer
    assert [f["seq"] for f in frames if f["type"] == "token"] == list(range(1, EVENTS))
    assert time.monotonic() - started < 30
    await fast.close()

    # the stalled client reads again and gets everything, in order
    frames = await slow.recv_until(lambda f: f["type"] == "done", 60)
    assert [f["seq"] for f in frames if f["type"] == "token"] == list(range(1, EVENTS))
    await slow.close()
