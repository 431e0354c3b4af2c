"""Limits of one gateway: connections (1013), streams per socket, queue length, floods (1008).

No model needed: a WorkerStore heartbeat stands in for a live worker's presence
(the requests simply stay queued).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed

from tests.gateway.procs import Client, start_gateway, wait_ready
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.worker.store import WorkerStore


@pytest.fixture(scope="module")
def limited(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs: Path = tmp_path_factory.mktemp("limit-logs")
    flags = ["--max-connections", "2", "--max-streams-per-connection", "2", "--max-pending", "3"]
    gw, addr = start_gateway(redis_server.url, "lim:", logs, *flags)
    try:
        wait_ready(addr, gw, 60, need_worker=False)
        yield addr
    finally:
        gw.stop()


def fake_worker(redis_server: EmbeddedRedis) -> WorkerStore:
    worker_store = WorkerStore(redis_server.url, "lim-worker", prefix="lim:")
    worker_store.ensure_group()
    worker_store.heartbeat(WorkerStats())
    return worker_store


async def test_too_many_connections_close_with_1013(limited: str) -> None:
    a, b = await Client.open(limited), await Client.open(limited)
    try:
        with pytest.raises(ConnectionClosed) as info:
            c = await Client.open(limited)
            await c.recv(5)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1013
    finally:
        await a.close()
        await b.close()
    await asyncio.sleep(0.2)
    c = await Client.open(limited)  # room again
    await c.close()


async def test_streams_per_socket_and_queue_length(
    limited: str, redis_server: EmbeddedRedis
) -> None:
    worker_store = fake_worker(redis_server)
    c = await Client.open(limited)
    d = await Client.open(limited)
    try:
        for i in range(2):
            await c.send({"type": "generate", "request_id": f"q{i}", "prompt": "hi"})
        await asyncio.sleep(0.3)
        await c.send({"type": "generate", "request_id": "q2", "prompt": "hi"})
        err = await c.recv(5)
        assert err["code"] == "rate_limited" and err["request_id"] == "q2"
        await d.send({"type": "generate", "request_id": "d0", "prompt": "hi"})
        await asyncio.sleep(0.3)
        await d.send({"type": "generate", "request_id": "d1", "prompt": "hi"})  # 4th queued
        err = await d.recv(5)
        assert err["code"] == "overloaded" and err["request_id"] == "d1"
    finally:
        await c.close()
        await d.close()
        redis_server.client().delete("lim:requests")
        worker_store.close()


async def _open_when_a_slot_is_free(url: str, wait: float = 10.0) -> Client:
    """Connect, retrying while the gateway still counts an earlier test's sockets (1013)."""
    deadline = asyncio.get_running_loop().time() + wait
    while True:
        try:
            return await Client.open(url)
        except ConnectionClosed:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_flooding_client_is_rate_limited_then_closed(limited: str) -> None:
    c = await _open_when_a_slot_is_free(limited)
    ping = json.dumps({"type": "ping"})

    async def flood() -> None:
        with contextlib.suppress(ConnectionClosed):
            for _ in range(20_000):
                await c.ws.send(ping)

    sender = asyncio.create_task(flood())
    kinds: dict[str, int] = {}
    with pytest.raises(ConnectionClosed) as info:
        while True:
            frame = await c.recv(30)
            key = frame.get("code", frame["type"])
            kinds[key] = kinds.get(key, 0) + 1
    sender.cancel()
    assert info.value.rcvd is not None and info.value.rcvd.code == 1008
    assert kinds.get("pong", 0) >= 200 and kinds.get("rate_limited", 0) > 0, kinds
