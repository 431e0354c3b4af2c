"""The I/O half of the SSE API: a streaming response that notices a client leave.

:class:`SSEResponse` is a Starlette response that writes the frames of an
async generator, sends a ``: keep-alive`` comment whenever the generator has
been quiet for ``keepalive`` seconds, and stops as soon as the client
disconnects (it listens for ``http.disconnect`` while waiting, instead of
finding out at the next write): the generator is then closed, and its
``finally`` detaches the stream. A generator that never started has no
``finally`` to run, so ``on_close`` (the same cleanup) runs too, however the
response ends: also when the headers could not be sent. :class:`Pump` reads an async iterator with a
timeout without ever cancelling a pending read (cancelling ``__anext__`` of a
generator would end it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Generic, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokenrelay.gateway.http.sse import KEEPALIVE

log = logging.getLogger("tokenrelay.sse")

T = TypeVar("T")

__all__ = ["GONE", "TIMEOUT", "Pump", "SSEResponse", "watch_disconnect"]


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


TIMEOUT = _Marker("TIMEOUT")  # nothing arrived in time
GONE = _Marker("GONE")  # the client disconnected


def watch_disconnect(receive: Receive) -> asyncio.Task[None]:
    """A task that ends when the client disconnects (call after reading the body)."""

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    return asyncio.create_task(watch(), name="http-disconnect")


async def _anext(source: AsyncIterator[T]) -> T:
    return await source.__anext__()


class Pump(Generic[T]):
    """Reads an async iterator item by item, with timeouts that lose nothing."""

    def __init__(self, source: AsyncIterator[T]) -> None:
        self._source = source
        self._next: asyncio.Future[T] | None = None
        self.exhausted = False

    async def next(
        self, timeout: float | None = None, gone: asyncio.Future[None] | None = None
    ) -> T | _Marker:
        """The next item, :data:`TIMEOUT`, or :data:`GONE` once ``gone`` is done.

        Raises ``StopAsyncIteration`` at the end (and whatever the source raises).
        """
        if self._next is None:
            self._next = asyncio.ensure_future(_anext(self._source))
        waiting: set[asyncio.Future[object]] = {self._next}  # type: ignore[arg-type]
        if gone is not None:
            waiting.add(gone)  # type: ignore[arg-type]
        done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if self._next in done:
            fut, self._next = self._next, None
            try:
                return fut.result()
            except StopAsyncIteration:
                self.exhausted = True
                raise
        if gone is not None and gone in done and not gone.cancelled():
            return GONE
        return TIMEOUT

    async def aclose(self) -> None:
        """Cancel a pending read and close the source."""
        fut, self._next = self._next, None
        if fut is not None and not fut.done():
            fut.cancel()
            with contextlib.suppress(BaseException):
                await fut
        elif fut is not None and not fut.cancelled():
            fut.exception()  # retrieved: no "exception was never retrieved" warning
        closer = getattr(self._source, "aclose", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                await closer()


class SSEResponse(Response):
    """``text/event-stream`` from an async generator of frames, with keep-alives.

    ``gone`` is the client's disconnect watch (:func:`watch_disconnect`);
    when None one is started. ``on_close`` runs last, whatever happened (it
    must be idempotent: the generator's ``finally`` may have run it already).
    ``completed`` tells afterwards whether the
    generator ran to its end (False: the client went away, or it failed).
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        frames: AsyncGenerator[bytes, None],
        *,
        headers: Mapping[str, str] | None = None,
        keepalive: float = 10.0,
        gone: asyncio.Task[None] | None = None,
        log_extra: Mapping[str, object] | None = None,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.frames = frames
        self.on_close = on_close
        self.keepalive = keepalive
        self.gone = gone
        self.log_extra = dict(log_extra or {})
        self.completed = False
        self.status_code = 200
        self.background = None
        base = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        base.update(headers or {})
        self.init_headers(base)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = self.gone or watch_disconnect(receive)
        pump: Pump[bytes] = Pump(self.frames)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            while True:
                try:
                    item = await pump.next(self.keepalive, gone)
                except StopAsyncIteration:
                    self.completed = True
                    break
                if item is GONE:
                    log.info("client disconnected", extra=self.log_extra)
                    break
                chunk = KEEPALIVE if item is TIMEOUT else item
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if self.completed:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # uvicorn's ClientDisconnected on a write
            log.info("client disconnected", extra=self.log_extra)
        except Exception:  # the connection closes unfinished: the client can resume
            log.exception("event stream failed", extra=self.log_extra)
        finally:
            gone.cancel()
            with contextlib.suppress(BaseException):
                await gone
            try:
                await pump.aclose()
            finally:
                if self.on_close is not None:
                    await self.on_close()
