"""Who a gRPC call comes from and how many are open: ``--forwarded-allow-ips`` and
``--max-connections`` as for the WebSocket.

A real gateway process with ``--grpc-port`` on the session's redis-server; a WorkerStore
heartbeat stands in for a live worker (requests stay queued, no model runs).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from websockets.exceptions import ConnectionClosed

from tests.gateway.grpc.client import CODE, GrpcClient, generate, pb2
from tests.gateway.procs import Client, free_port, start_gateway, wait_ready
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.worker.store import WorkerStore

FAR = "203.0.113.7"  # an address off this host (TEST-NET-3)


@dataclass
class Peers:
    addr: str  # HTTP and WebSocket
    grpc_addr: str
    worker: WorkerStore

    async def generate(self, c: GrpcClient, rid: str) -> dict[str, Any] | None:
        """The error a generate gets at once; ``None`` when it is queued (a stream starts
        once a worker takes it: a ping's pong comes back first)."""
        await c.send(generate("hi", rid, max_tokens=2))
        await c.send(ping=pb2.Ping())
        frames = await c.recv_until(lambda f: f["type"] == "pong", 10)
        errors = [f for f in frames if f["type"] == "error" and f["request_id"] == rid]
        return errors[0] if errors else None


def _gateway(redis_server: EmbeddedRedis, logs: Path, *flags: str) -> Iterator[Peers]:
    prefix = f"peers{secrets.token_hex(3)}:"
    grpc_port = free_port()
    gw, addr = start_gateway(redis_server.url, prefix, logs, "--grpc-port", str(grpc_port), *flags)
    worker = WorkerStore(redis_server.url, f"{prefix}worker", prefix=prefix)
    worker.ensure_group()
    stop = threading.Event()

    def beat() -> None:  # a worker "is running" all along; the requests just stay queued
        while not stop.is_set():
            worker.heartbeat(WorkerStats())
            stop.wait(0.3)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        wait_ready(addr, gw, 60, need_worker=False)
        time.sleep(1.1)  # past the gateway's cache of live workers (1 s)
        yield Peers(addr, f"127.0.0.1:{grpc_port}", worker)
    finally:
        gw.stop()
        stop.set()
        beating.join()
        worker.close()


@pytest.fixture
def per_address(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[Peers]:
    """No keys, one stream per client address; loopback is the trusted proxy (default)."""
    yield from _gateway(redis_server, tmp_path, "--max-streams-per-address", "1")


@pytest.fixture
def untrusting(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[Peers]:
    """The same, believing only a proxy at 192.0.2.1: loopback's X-Forwarded-For is not."""
    flags = ("--max-streams-per-address", "1", "--forwarded-allow-ips", "192.0.2.1")
    yield from _gateway(redis_server, tmp_path, *flags)


@pytest.fixture
def one_connection(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[Peers]:
    yield from _gateway(redis_server, tmp_path, "--max-connections", "1")


async def _open(grpc_addr: str, forwarded: str | None) -> GrpcClient:
    channel = grpc.aio.insecure_channel(grpc_addr)
    metadata = (("x-forwarded-for", forwarded),) if forwarded else None
    client = GrpcClient(channel, CODE.pb2_grpc.RelayStub(channel).Chat(metadata=metadata))
    client.hello = await client.recv(10)
    assert client.hello["type"] == "hello", client.hello
    return client


async def test_a_trusted_proxys_x_forwarded_for_names_the_client(
    per_address: Peers,
) -> None:
    grpc_addr, gen = per_address.grpc_addr, per_address.generate
    far = await _open(grpc_addr, f"{FAR}, 127.0.0.1")  # the client, then a proxy on loopback
    other = await _open(grpc_addr, "203.0.113.8")
    local = await _open(grpc_addr, None)
    try:
        assert await gen(far, "a1") is None
        refused = await gen(far, "a2")
        assert refused is not None and refused["code"] == "rate_limited", refused
        assert "per client address" in refused["message"]
        assert await gen(other, "b1") is None  # another address: its own slots
        for i in range(3):  # loopback itself is not counted
            assert await gen(local, f"l{i}") is None
    finally:
        for c in (far, other, local):
            await c.close()


async def test_an_untrusted_peers_x_forwarded_for_is_ignored(
    untrusting: Peers,
) -> None:
    grpc_addr, gen = untrusting.grpc_addr, untrusting.generate
    c = await _open(grpc_addr, FAR)  # says it is far away, comes from loopback: loopback
    try:
        for i in range(3):
            assert await gen(c, f"u{i}") is None
    finally:
        await c.close()


async def test_websockets_and_calls_share_max_connections(
    one_connection: Peers,
) -> None:
    addr, grpc_addr = one_connection.addr, one_connection.grpc_addr
    call = await _open(grpc_addr, None)
    try:
        with pytest.raises(ConnectionClosed) as info:  # the call holds the one connection
            ws = await Client.open(addr)
            await ws.recv(5)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1013
    finally:
        await call.close()
    await asyncio.sleep(0.3)
    ws = await Client.open(addr)  # room again; now the socket holds it
    try:
        second = await GrpcClient.open(grpc_addr, hello=False)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await second.recv(10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await second.close()
    finally:
        await ws.close()
