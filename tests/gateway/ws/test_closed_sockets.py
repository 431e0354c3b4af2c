"""A socket closed while its streams wait leaves nothing behind in the gateway.

A client that sends ``generate`` and closes at once can close while the new
stream's tail is still in its first Redis read. redis-py may swallow the
cancellation of a command in flight; the tail then went on to wait for the
stream's end, holding the connection (and its attachment, so no detach timeout
ever ran) for as long as the stream lived. Here a fake worker keeps
heartbeating but never takes the requests, so such a tail would wait forever.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.procs import Client, start_gateway, wait_ready
from tokenrelay.core.redis.connection import raise_if_cancel_swallowed
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.worker.store import WorkerStore

PREFIX = "gone:"


@pytest.fixture(scope="module")
def idle_gateway(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A gateway whose only worker heartbeats and never starts a request."""
    logs: Path = tmp_path_factory.mktemp("gone-logs")
    worker_store = WorkerStore(redis_server.url, "gone-worker", prefix=PREFIX)
    worker_store.ensure_group()
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            worker_store.heartbeat(WorkerStats())
            stop.wait(0.5)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    gw, addr = start_gateway(redis_server.url, PREFIX, logs, "--drain-timeout", "1")
    try:
        wait_ready(addr, gw, 60)
        yield addr
    finally:
        gw.stop()
        stop.set()
        beater.join()
        worker_store.close()


def gauges(addr: str) -> dict[str, float]:
    text = httpx.get(f"http://{addr}/metrics", timeout=10).text
    names = ("tokenrelay_websocket_connections", "tokenrelay_gateway_streams_attached")
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[name] = float(value)
    assert set(out) == set(names), text[:2000]
    return out


async def test_sockets_closed_right_after_generate_leave_nothing(idle_gateway: str) -> None:
    # closes 0 to 4 ms after the generate: some land while the new tail's first read is
    # in flight (without the fix, 2 to 7 of 60 sockets stayed open here)
    for i in range(60):
        c = await Client.open(idle_gateway)
        await c.send({"type": "generate", "request_id": f"g{i}", "prompt": "hi"})
        await asyncio.sleep(0.0005 * (i % 9))
        await c.close()
    deadline = time.monotonic() + 5
    while (now := gauges(idle_gateway)) and any(now.values()) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not any(now.values()), f"left behind after every client closed: {now}"


async def test_a_swallowed_cancel_is_raised_again() -> None:
    reached = asyncio.Event()
    after: list[str] = []

    async def swallowing_call() -> str:  # what redis-py may do with a cancel in flight
        reached.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return "answer"
        return "late"

    async def loop() -> None:
        await swallowing_call()
        raise_if_cancel_swallowed()
        after.append("went on")

    task = asyncio.create_task(loop())
    await reached.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert after == []


async def test_no_cancel_no_raise() -> None:
    raise_if_cancel_swallowed()  # a task that was never cancelled goes on
