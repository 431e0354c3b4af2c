"""bench/ws_client.py's LightClient against a real ``websockets`` server.

The load generator of bench/gateway.py reads every frame through it, so it must
get the protocol right: the handshake, fragmented messages, pongs, the closing
handshake, and the hand-over from queued reads to the streaming callback.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import pytest
from websockets.asyncio.server import ServerConnection, serve

from bench.ws_client import LightClient


@pytest.fixture
async def server_url() -> AsyncIterator[tuple[str, asyncio.Queue[str]]]:
    """A server that says hello, echoes one frame, then streams what the test scripts."""
    heard: asyncio.Queue[str] = asyncio.Queue()

    async def handler(ws: ServerConnection) -> None:
        await ws.send("hello")
        heard.put_nowait(str(await ws.recv()))
        await ws.send(["frag", "mented ", "message"])  # one message in three frames
        pong = await ws.ping()
        await asyncio.wait_for(pong, 5)  # the client answered the ping
        heard.put_nowait("pong")
        for i in range(100):
            await ws.send(f"m{i}")
        await ws.wait_closed()
        heard.put_nowait(f"closed {ws.close_code}")

    async with serve(handler, "127.0.0.1", 0, compression=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f"ws://127.0.0.1:{port}/", heard


async def test_light_client_reads_and_streams_in_order(
    server_url: tuple[str, asyncio.Queue[str]],
) -> None:
    url, heard = server_url
    before = time.time()
    client = await LightClient.open(url, 5)
    text, at = await client.recv(5)
    assert text == "hello"
    assert before <= at <= time.time()
    client.send("resume")
    assert await asyncio.wait_for(heard.get(), 5) == "resume"
    assert await asyncio.wait_for(heard.get(), 5) == "pong"
    got: list[str] = []
    done = asyncio.get_running_loop().create_future()

    def on_text(msg: str, when: float) -> None:
        assert when >= at
        got.append(msg)
        if msg == "m99":
            done.set_result(None)

    client.stream(on_text)  # what was queued before comes first
    await asyncio.wait_for(done, 5)
    assert got == ["fragmented message"] + [f"m{i}" for i in range(100)]
    await client.close()
    assert client.closed.done()
    assert await asyncio.wait_for(heard.get(), 5) == "closed 1000"


def free_port() -> int:
    """A local port with nothing listening on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_light_client_open_fails_cleanly_without_a_server() -> None:
    with pytest.raises(OSError):
        await LightClient.open(f"ws://127.0.0.1:{free_port()}/", 5)
