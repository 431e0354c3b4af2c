"""Small asyncio servers that play an upstream, for the relay's client and call tests.

:class:`Server` runs ``handler(reader, writer, n)`` for its n-th connection and keeps the
requests it read; :func:`serving` gives one with an :class:`HttpClient` in front of it.
``chunk`` frames bytes as one HTTP chunk, ``event`` one server-sent event of JSON data.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from tokenrelay.worker.upstream.client import HttpClient

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]

OK_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


class Server:
    """A TCP server running ``handler(reader, writer, n)`` for its n-th connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.decode("latin-1").split("\r\n"):
            name, _, value = line.partition(":")
            if name.lower() == "content-length":
                length = int(value)
        raw = head + await reader.readexactly(length)
        self.requests.append(raw)
        return raw

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[Server]:
    """A :class:`Server` listening on a free loopback port for the block's length."""
    srv = Server(handler)
    srv.server = await asyncio.start_server(srv._serve, "127.0.0.1", 0)
    try:
        yield srv
    finally:
        srv.server.close()


@contextlib.asynccontextmanager
async def serving(handler: Handler, **kwargs: float) -> AsyncIterator[tuple[Server, HttpClient]]:
    async with serve(handler) as srv:
        client = HttpClient(srv.url, timeout=kwargs.get("timeout", 5.0), connect_timeout=2.0,
                            max_connections=4)  # fmt: skip
        try:
            yield srv, client
        finally:
            await client.aclose()


def sse_head(**headers: str) -> bytes:
    """A 200 event stream's head, chunked, with ``headers`` (``X_Stream_Id``: X-Stream-Id)."""
    lines = ["HTTP/1.1 200 OK", "Content-Type: text/event-stream", "Transfer-Encoding: chunked"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(obj: Any) -> bytes:
    """One server-sent event of ``obj``'s JSON (``[DONE]`` as it is), as an HTTP chunk."""
    data = obj if isinstance(obj, str) else json.dumps(obj)
    return chunk(b"data: %s\n\n" % data.encode())


def delta(text: str = "", finish: str | None = None, usage: tuple[int, int] | None = None) -> bytes:
    """An OpenAI chat chunk event: a text delta, a finish reason, a usage."""
    obj: dict[str, Any] = {"choices": [{"index": 0, "delta": {"content": text},
                                        "finish_reason": finish}]}  # fmt: skip
    if usage is not None:
        obj["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1]}
    return event(obj)


async def until_closed(reader: asyncio.StreamReader, timeout: float = 20.0) -> bool:
    """Wait for the client to close its end (True), or ``timeout`` seconds (False)."""
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


async def trickle(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    parts: Iterable[bytes],
    every: float = 0.0,
    timeout: float = 20.0,
) -> bool:
    """Write each of ``parts``, ``every`` seconds apart, until the client closes its end;
    then (the parts out) wait for it up to ``timeout``. Whether the client closed."""
    gone = asyncio.ensure_future(until_closed(reader, timeout))
    try:
        for part in parts:
            if gone.done():
                break
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(every)
        return await gone
    except ConnectionError:
        return True
    finally:
        gone.cancel()
