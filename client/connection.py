"""One WebSocket to a gateway's ``/v1/ws``, shared by the streams of a client.

:func:`open_connection` opens the socket and reads its ``hello``; a refusal the client
cannot get past by retrying raises its typed error (:class:`AuthenticationError` when the
gateway answers ``unauthorized``, :class:`PermissionDeniedError` for a refused origin),
anything else (refused, reset, closed with 1013 or 1001, a 5xx) raises
:class:`Unreachable`, which the pool (client/pool.py) retries with backoff.

A :class:`Connection` reads its frames in a task of its own and hands each to the
:class:`Sink` registered for its ``stream_id`` (or, for ``started`` and errors about a
``generate``, its ``request_id``); when the socket is gone, every sink registered on it
gets ``None``. A ``notice`` ``shutting_down`` marks it draining: it keeps delivering the
streams it carries until the gateway closes it, and nothing new goes out on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from tokenrelay.client.errors import (
    AuthenticationError,
    NotFoundError,
    PermissionDeniedError,
    TokenRelayError,
    error_for,
)
from tokenrelay.client.frames import (
    SHUTTING_DOWN,
    WORKER_READY,
    ErrorFrame,
    Hello,
    Notice,
    ServerFrame,
    Started,
    decode,
    encode,
)
from tokenrelay.client.retry import RETRYABLE_CODES

__all__ = ["Connection", "Sink", "Unreachable", "open_connection", "ws_url"]

log = logging.getLogger("tokenrelay.client")

WS_PATH = "/v1/ws"


class Unreachable(Exception):
    """The socket could not be opened, or closed before its ``hello``: worth a retry."""


class Sink(Protocol):
    """Where a connection hands the frames of one stream attachment."""

    def deliver(self, frame: ServerFrame | None) -> None:
        """A frame about the stream; ``None``: the socket is gone."""
        ...


def ws_url(url: str) -> str:
    """The WebSocket URL of a gateway: ``http(s)://host[:port][/prefix]`` (or ``ws(s)://``)
    to ``ws(s)://host[:port][/prefix]/v1/ws``."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme.lower())
    if scheme is None or not parts.netloc:
        raise ValueError(f"not an http(s):// or ws(s):// URL: {url!r}")
    path = parts.path.rstrip("/")
    if not path.endswith(WS_PATH):
        path += WS_PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


class Connection:
    """An open socket, its reader task and its routing table (see the module)."""

    def __init__(self, ws: ClientConnection, hello: Hello) -> None:
        self.ws = ws
        self.hello = hello
        self.draining = False  # the gateway announced a drain: nothing new goes out here
        self.closed = False
        self.useful = False  # it delivered a frame of a stream (the pool resets its backoff)
        self.close_code: int | None = None
        self.on_close: Callable[[Connection], None] | None = None
        self.on_ready: Callable[[], None] | None = None  # a ``worker_ready`` notice came
        self._by_request: dict[str, Sink] = {}
        self._by_stream: dict[str, Sink] = {}
        self._reader = asyncio.create_task(self._read(), name="tokenrelay-client-reader")

    @property
    def usable(self) -> bool:
        """Open and not draining: new streams may go out on it."""
        return not self.closed and not self.draining

    def register(
        self, sink: Sink, *, request_id: str | None = None, stream_id: str | None = None
    ) -> None:
        """Route the frames of ``request_id`` / ``stream_id`` to ``sink`` (a closed socket
        hands it ``None`` at once)."""
        if self.closed:
            sink.deliver(None)
            return
        if request_id is not None:
            self._by_request[request_id] = sink
        if stream_id is not None:
            self._by_stream[stream_id] = sink

    def unregister(self, sink: Sink) -> None:
        """Stop routing anything to ``sink``."""
        for table in (self._by_request, self._by_stream):
            for key in [k for k, v in table.items() if v is sink]:
                del table[key]

    async def send(self, frame: Mapping[str, Any]) -> bool:
        """Send one frame; False when the socket is gone (its sinks hear of it)."""
        if self.closed:
            return False
        try:
            await self.ws.send(encode(frame))
        except ConnectionClosed:
            return False
        return True

    async def close(self) -> None:
        """Close the socket (the gateway detaches its streams) and wait for the reader."""
        with contextlib.suppress(Exception):
            await self.ws.close()
        with contextlib.suppress(BaseException):
            await self._reader

    async def _read(self) -> None:
        try:
            async for text in self.ws:
                self._route(decode(text))
        except ConnectionClosed:
            pass
        except Exception:  # a bug here must not leave the streams waiting forever
            log.exception("tokenrelay client: reading the socket failed")
            await self.ws.close()
        finally:
            self.closed = True
            self.close_code = self.ws.close_code
            sinks = {*self._by_request.values(), *self._by_stream.values()}
            self._by_request.clear()
            self._by_stream.clear()
            for sink in sinks:
                sink.deliver(None)
            if self.on_close is not None:
                self.on_close(self)

    def _route(self, f: ServerFrame) -> None:
        if isinstance(f, Notice):
            if f.code == SHUTTING_DOWN:
                self.draining = True
            elif f.code == WORKER_READY and self.on_ready is not None:
                self.on_ready()
            return
        sink: Sink | None = None
        if isinstance(f, Started):
            sink = self._by_request.get(f.request_id or "")
            if sink is not None:
                self._by_stream[f.stream_id] = sink
        elif isinstance(f, ErrorFrame):
            sink = self._by_stream.get(f.stream_id or "") or self._by_request.get(
                f.request_id or ""
            )
            if sink is None:
                log.warning("tokenrelay client: gateway error %s: %s", f.code, f.message)
        else:
            sink = self._by_stream.get(getattr(f, "stream_id", None) or "")
        if sink is not None:
            self.useful = True
            sink.deliver(f)


async def open_connection(
    url: str, headers: Mapping[str, str], *, open_timeout: float, max_size: int | None = None
) -> Connection:
    """Open ``url`` (a ``ws(s)://`` URL) and read its ``hello``; see the module for what
    it raises."""
    try:
        ws = await connect(url, additional_headers=dict(headers), open_timeout=open_timeout,
                           max_size=max_size)  # fmt: skip
    except InvalidStatus as exc:
        status = exc.response.status_code
        if status == 401:
            raise AuthenticationError(f"the gateway refused the handshake (HTTP {status})") from exc
        if status == 403:
            raise PermissionDeniedError(
                f"the gateway refused the handshake (HTTP {status}): origin not allowed"
            ) from exc
        if status == 404:
            raise NotFoundError(f"no WebSocket endpoint at {url} (HTTP 404)") from exc
        raise Unreachable(f"HTTP {status} from {url}") from exc
    except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed) as exc:
        raise Unreachable(f"cannot connect to {url}: {exc!r}") from exc
    try:
        async with asyncio.timeout(open_timeout):
            first = decode(await ws.recv())
    except (ConnectionClosed, TimeoutError) as exc:
        await ws.close()
        raise Unreachable(f"{url} closed before its hello: {exc!r}") from exc
    if isinstance(first, ErrorFrame):
        await ws.close()
        error: TokenRelayError = error_for(first.code, first.message)
        if first.code in RETRYABLE_CODES:
            raise Unreachable(str(error)) from error
        raise error
    if not isinstance(first, Hello):
        await ws.close()
        raise Unreachable(f"{url} did not say hello: {first!r}")
    return Connection(ws, first)
