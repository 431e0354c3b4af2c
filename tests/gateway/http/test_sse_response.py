"""gateway/http/sse_response.py: keep-alives, disconnects, lossless timeouts (ASGI, no server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from starlette.types import Message

from tokenrelay.gateway.http.sse import KEEPALIVE
from tokenrelay.gateway.http.sse_response import GONE, TIMEOUT, Pump, SSEResponse


class Client:
    """An ASGI client side: records what is sent, can disconnect."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.left = asyncio.Event()

    async def receive(self) -> Message:
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(dict(message))

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}}


async def test_pump_timeouts_lose_nothing() -> None:
    async def slow() -> AsyncGenerator[int, None]:
        for i in range(3):
            await asyncio.sleep(0.05)
            yield i

    pump: Pump[int] = Pump(slow())
    got: list[int] = []
    timeouts = 0
    while True:
        try:
            item = await pump.next(0.01)
        except StopAsyncIteration:
            break
        if item is TIMEOUT:
            timeouts += 1
        else:
            assert isinstance(item, int)
            got.append(item)
    assert got == [0, 1, 2] and timeouts >= 3 and pump.exhausted


async def test_pump_gone_and_close_runs_finally() -> None:
    closed = asyncio.Event()

    async def forever() -> AsyncGenerator[int, None]:
        try:
            await asyncio.sleep(3600)
            yield 1
        finally:
            closed.set()

    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    pump: Pump[int] = Pump(forever())
    gone.set_result(None)
    assert await pump.next(5, gone) is GONE
    await pump.aclose()
    assert closed.is_set()


async def test_keepalive_while_quiet_then_done() -> None:
    async def frames() -> AsyncGenerator[bytes, None]:
        yield b"data: a\n\n"
        await asyncio.sleep(0.35)
        yield b"data: [DONE]\n\n"

    client = Client()
    resp = SSEResponse(frames(), headers={"X-Stream-Id": "s"}, keepalive=0.1)
    await resp(SCOPE, client.receive, client.send)
    start = client.sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache" and headers["x-accel-buffering"] == "no"
    assert headers["x-stream-id"] == "s"
    body = client.body()
    assert body.startswith(b"data: a\n\n") and body.endswith(b"data: [DONE]\n\n")
    assert body.count(KEEPALIVE) >= 2
    assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert resp.completed


async def test_disconnect_while_quiet_closes_the_generator() -> None:
    cleaned = asyncio.Event()

    async def frames() -> AsyncGenerator[bytes, None]:
        try:
            yield b"data: a\n\n"
            await asyncio.sleep(3600)
            yield b"never"
        finally:
            cleaned.set()

    client = Client()
    resp = SSEResponse(frames(), keepalive=60)
    task = asyncio.create_task(resp(SCOPE, client.receive, client.send))
    await asyncio.sleep(0.05)
    client.left.set()
    await asyncio.wait_for(task, 2)
    assert cleaned.is_set() and not resp.completed
    assert client.body() == b"data: a\n\n"
    assert all(m.get("more_body", True) for m in client.sent[1:])  # never "finished"


async def test_write_failure_counts_as_disconnect() -> None:
    cleaned = asyncio.Event()

    async def frames() -> AsyncGenerator[bytes, None]:
        try:
            while True:
                yield b"data: x\n\n"
        finally:
            cleaned.set()

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            raise OSError("client went away")

    resp = SSEResponse(frames(), keepalive=60)
    await resp(SCOPE, Client().receive, send)
    assert cleaned.is_set() and not resp.completed


async def test_on_close_runs_when_the_headers_cannot_be_sent() -> None:
    """A generator that never started has no ``finally``: on_close still cleans up."""
    started, closed = asyncio.Event(), []

    async def frames() -> AsyncGenerator[bytes, None]:
        started.set()
        yield b"data: x\n\n"

    async def on_close() -> None:
        closed.append(1)

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":  # a client gone, a header h11 refuses
            raise RuntimeError("Illegal header value")

    resp = SSEResponse(frames(), keepalive=60, on_close=on_close)
    await resp(SCOPE, Client().receive, send)
    assert closed == [1] and not started.is_set() and not resp.completed
    client = Client()
    done = SSEResponse(frames(), keepalive=60, on_close=on_close)
    await done(SCOPE, client.receive, client.send)  # and after a normal end too
    assert closed == [1, 1] and done.completed
