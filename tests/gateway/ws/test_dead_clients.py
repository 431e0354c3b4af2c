"""Dead clients: a socket that stops answering pings is closed by the heartbeat.

A raw TCP client performs the WebSocket handshake and then goes silent (never
reads, never answers the server's pings), as a phone that lost its network
does. With ``--heartbeat 1`` the gateway must drop it within a few seconds and
release its slot (``--max-connections 1``: a new client gets in afterwards).
tests/gateway/streams/test_backpressure.py covers the other half: a client that
reads nothing cannot grow the gateway's memory.
"""

from __future__ import annotations

import base64
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.procs import Client, start_gateway, wait_ready
from tokenrelay.core.redis.embedded import EmbeddedRedis


@pytest.fixture(scope="module")
def beating(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs: Path = tmp_path_factory.mktemp("dead-logs")
    flags = ["--heartbeat", "1", "--max-connections", "1"]
    gw, addr = start_gateway(redis_server.url, "dead:", logs, *flags)
    try:
        wait_ready(addr, gw, 60, need_worker=False)
        yield addr
    finally:
        gw.stop()


def silent_client(addr: str) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        (f"GET /v1/ws HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
         f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()
    )  # fmt: skip
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


async def test_heartbeat_closes_a_silent_socket(beating: str) -> None:
    sock = silent_client(beating)
    try:
        time.sleep(4.0)  # heartbeat 1 s + ping timeout 1 s, with room: no answer at all
        sock.settimeout(1)
        closed_at = None
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue  # still open
            except ConnectionResetError:
                data = b""
            if not data:
                closed_at = time.monotonic()
                break
        assert closed_at is not None, "the gateway kept a dead socket open"
    finally:
        sock.close()
    c = await Client.open(beating)  # its slot (--max-connections 1) is free again
    await c.close()
