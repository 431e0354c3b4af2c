"""The client's sockets against scripted WebSocket servers (no gateway, no model): URLs,
routing, refusals, reconnects with backoff, and a stream that resumes on a new socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Response

from tokenrelay.client import (
    AsyncClient,
    AuthenticationError,
    ConnectionFailed,
    FinishReason,
    NotFoundError,
    PermissionDeniedError,
    RetryPolicy,
)
from tokenrelay.client.connection import ws_url

FAST = RetryPolicy(limit=2, initial=0.01, maximum=0.05)
HELLO = {"type": "hello", "protocol": 1, "heartbeat_s": 20, "max_frame_bytes": 4096,
         "server": "fake", "worker_ready": True}  # fmt: skip
Handler = Callable[[ServerConnection], Awaitable[None]]


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("http://127.0.0.1:8000", "ws://127.0.0.1:8000/v1/ws"),
        ("https://chat.example.com/", "wss://chat.example.com/v1/ws"),
        ("https://example.com/llm", "wss://example.com/llm/v1/ws"),
        ("ws://h:1/v1/ws", "ws://h:1/v1/ws"),
        ("WSS://h/v1/ws?x=1", "wss://h/v1/ws?x=1"),
    ],
)
def test_gateway_urls_become_websocket_urls(given: str, url: str) -> None:
    assert ws_url(given) == url


def test_other_urls_are_refused() -> None:
    for bad in ("ftp://h", "127.0.0.1:8000", "http://"):
        with pytest.raises(ValueError):
            ws_url(bad)


@contextlib.asynccontextmanager
async def fake(handler: Handler, **kw: Any) -> AsyncIterator[str]:
    """A scripted WebSocket server on a free port: its http:// URL."""
    async with serve(handler, "127.0.0.1", 0, **kw) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f"http://127.0.0.1:{port}"


async def send(ws: ServerConnection, **frame: Any) -> None:
    await ws.send(json.dumps(frame))


async def test_an_unauthorized_gateway_raises_at_once() -> None:
    async def refuse(ws: ServerConnection) -> None:
        await send(ws, type="error", code="unauthorized", message="missing API key")
        await ws.close(1008)

    async with fake(refuse) as url, AsyncClient(url, retry=FAST) as c:
        with pytest.raises(AuthenticationError, match="missing API key"):
            await c.chat([{"role": "user", "content": "Hi"}])
        assert c.connects == 0


async def test_a_refused_origin_is_forbidden() -> None:
    def process_request(ws: ServerConnection, request: Any) -> Response:
        return ws.respond(403, "no\n")

    async def never(ws: ServerConnection) -> None:
        raise AssertionError("not reached")

    async with fake(never, process_request=process_request) as url, AsyncClient(url) as c:
        with pytest.raises(PermissionDeniedError):
            await c.complete("Hi")


async def test_sockets_closed_at_once_are_retried_then_given_up() -> None:
    opened = 0

    async def full(ws: ServerConnection) -> None:
        nonlocal opened
        opened += 1
        await ws.close(1013)  # too many connections: try again later

    async with fake(full) as url, AsyncClient(url, retry=FAST) as c:
        with pytest.raises(ConnectionFailed):
            await c.complete("Hi")
    assert opened == FAST.limit + 1


async def test_a_stream_resumes_on_a_new_socket_and_frames_route_by_stream() -> None:
    """Socket 1 starts the stream and dies after seq 2; socket 2 gets the resume and ends it.
    A second stream on socket 1 is resumed too; an unknown stream's frames are ignored."""
    seen: list[dict[str, Any]] = []

    async def gateway(ws: ServerConnection) -> None:
        await send(ws, **HELLO)
        async for raw in ws:
            f = json.loads(raw)
            seen.append(f)
            sid = "S" if f.get("request_id") == "r1" or f.get("stream_id") == "S" else "U"
            if f["type"] == "generate":
                await send(ws, type="started", request_id=f["request_id"], stream_id=sid,
                           resume_token="T" + sid, prompt_tokens=2)  # fmt: skip
                await send(ws, type="token", stream_id="X", seq=1, text="not ours")
                await send(ws, type="token", stream_id=sid, seq=1, text=sid + "1")
                await send(ws, type="token", stream_id=sid, seq=2, text=sid + "2")
                if sid == "U":
                    await ws.close()  # dropped mid-answer (socket 1)
                    return
            elif f["type"] == "resume":
                await send(ws, type="resumed", stream_id=sid, after=f["after"])
                await send(ws, type="token", stream_id=sid, seq=2, text=sid + "2")  # a repeat
                await send(ws, type="token", stream_id=sid, seq=3, text=sid + "3")
                await send(ws, type="done", stream_id=sid, seq=4, finish_reason="length",
                           usage={"prompt_tokens": 2, "completion_tokens": 3})  # fmt: skip

    async with fake(gateway) as url, AsyncClient(url, retry=FAST) as c:
        s = await c.chat([{"role": "user", "content": "Hi"}], request_id="r1", max_tokens=3)
        u = await c.complete("Hi", request_id="r2")
        assert await s.wait() == "S1S2S3" and await u.wait() == "U1U2U3"
        assert s.finish_reason == FinishReason.LENGTH and s.usage and s.usage.total_tokens == 5
        assert (s.resumes, s.duplicates, u.resumes, u.duplicates) == (1, 1, 1, 1)
        assert c.connects == 2
    resumes = sorted((f["stream_id"], f["after"]) for f in seen if f["type"] == "resume")
    assert resumes == [("S", 2), ("U", 2)]
    assert seen[0]["params"] == {"max_tokens": 3}


async def test_a_drain_notice_sends_new_streams_to_a_new_socket() -> None:
    sockets = 0

    async def gateway(ws: ServerConnection) -> None:
        nonlocal sockets
        sockets += 1
        mine = sockets
        await send(ws, **HELLO)
        async for raw in ws:
            f = json.loads(raw)
            sid = f"S{mine}"
            await send(ws, type="started", request_id=f["request_id"], stream_id=sid,
                       resume_token="T", prompt_tokens=2)  # fmt: skip
            if mine == 1:
                await send(ws, type="notice", code="shutting_down", drain_s=1, message="bye")
            await send(ws, type="done", stream_id=sid, seq=1, finish_reason="stop")

    async with fake(gateway) as url, AsyncClient(url, retry=FAST) as c:
        first = await c.complete("a")
        await first.wait()
        second = await c.complete("b")
        assert (first.stream_id, second.stream_id) == ("S1", "S2")
        assert c.drains == 1 and c.connects == 2


async def test_a_generate_refused_for_want_of_a_worker_goes_again_once_one_is_ready() -> None:
    generates = 0

    async def loading(ws: ServerConnection) -> None:
        nonlocal generates
        await send(ws, **{**HELLO, "worker_ready": False})
        async for raw in ws:
            f = json.loads(raw)
            generates += 1
            if generates == 1:
                await send(ws, type="error", code="unavailable", message="no engine worker",
                           request_id=f["request_id"])  # fmt: skip
                await asyncio.sleep(0.1)
                await send(ws, type="notice", code="worker_ready", message="ready")
                continue
            await send(ws, type="started", request_id=f["request_id"], stream_id="S",
                       resume_token="T", prompt_tokens=1)  # fmt: skip
            await send(ws, type="done", stream_id="S", seq=1, finish_reason="stop")

    # without the notice the retry would wait the default hint of `unavailable` (2 s)
    async with fake(loading) as url, AsyncClient(url, retry=FAST) as c:
        t0 = time.monotonic()
        s = await c.complete("Hi")
        assert time.monotonic() - t0 < 1.5 and s.retries == 1 and generates == 2


async def test_a_chat_given_up_before_its_start_is_cancelled_once_it_starts() -> None:
    got: list[dict[str, Any]] = []
    cancelled = asyncio.Event()

    async def slow(ws: ServerConnection) -> None:
        await send(ws, **HELLO)
        async for raw in ws:
            f = json.loads(raw)
            got.append(f)
            if f["type"] == "generate":
                await asyncio.sleep(0.3)  # a long queue
                await send(ws, type="started", request_id=f["request_id"], stream_id="S",
                           resume_token="T", prompt_tokens=1)  # fmt: skip
            elif f["type"] == "cancel":
                await send(ws, type="done", stream_id="S", seq=1, finish_reason="cancelled")
                cancelled.set()

    async with fake(slow) as url, AsyncClient(url, retry=FAST) as c:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(c.complete("Hi"), 0.1)
        await asyncio.wait_for(cancelled.wait(), 5)
    assert [f["type"] for f in got] == ["generate", "cancel"]
    assert got[1] == {"type": "cancel", "stream_id": "S", "resume_token": "T"}


async def test_a_malformed_stream_id_is_not_found_without_asking() -> None:
    async with AsyncClient("http://127.0.0.1:9") as c:  # nothing listens there
        with pytest.raises(NotFoundError):
            await c.resume("no such id!", "T")
        assert c.connects == 0
