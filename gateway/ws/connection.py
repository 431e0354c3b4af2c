"""``/v1/ws``: one full-duplex WebSocket carrying any number of streams.

Per socket there is a reader loop (client frames, answered in order), one tail task per
stream (replay + live events from the Redis log) and one writer task. A tail writes its
token frames itself when nothing is queued and no write is in progress (the common case: no
task switch between an event and its socket); everything else, and every frame the reader
loop answers with, goes through a bounded send queue that the writer empties, so the reader
never waits for a slow client's socket. When the client reads slowly, the socket stops
being writable, the queue fills, the tails stop pulling from Redis (the log is the buffer)
and nothing else waits. Writes take ``_send_lock`` (first come, first served), so each
stream's frames leave in the order its tail produced them. docs/protocol.md is the
reference for the frames. What a stream needs (generate, resume, cancel, per-key slots,
attachments, the tail) is gateway/session/stream_session.py's ``StreamSession``, as for
gRPC calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from tokenrelay.core.wire.vocabulary import ErrorCode
from tokenrelay.gateway.access.guard import Principal
from tokenrelay.gateway.errors import AuthError
from tokenrelay.gateway.session import protocol as p
from tokenrelay.gateway.session.stream_session import FrameRate, StreamSession

if TYPE_CHECKING:
    from tokenrelay.gateway.state import Gateway

log = logging.getLogger("tokenrelay.ws")


class _Close:
    def __init__(self, code: int, reason: str = "") -> None:
        self.code, self.reason = code, reason


_STOP = _Close(0)  # queued for the writer to end without writing anything


class Connection(StreamSession):
    """One accepted WebSocket and the streams it carries."""

    transport = "ws"
    channel = "socket"

    def __init__(self, ws: WebSocket, gw: Gateway) -> None:
        super().__init__(gw.session_parts, Principal(None))  # principal: websocket_endpoint
        self.gw = gw
        self.ws = ws
        self.queue: asyncio.Queue[str | _Close] = asyncio.Queue(gw.settings.send_queue)
        self.rate = FrameRate()
        self._closing = False  # no new frames are taken (what is queued still goes)
        self._dead = False  # a write failed: nothing more can be sent
        self._send_lock = asyncio.Lock()  # one socket write at a time, in arrival order

    # --- lifecycle ---------------------------------------------------------------

    async def run(self) -> None:
        await self.ws.accept()
        writer = asyncio.create_task(self._write_loop(), name="ws-writer")
        try:
            if self.gw.shutting_down:
                self.close(p.CLOSE_GOING_AWAY, "gateway shutting down")
            elif self.gw.open_connections() > self.gw.settings.max_connections:
                self.close(p.CLOSE_OVERLOADED, "too many connections")
            else:
                hello = await self.gw.hello()
                await self.send(hello)
                self.waiting_for_worker = not hello["worker_ready"]  # a notice will follow
                await self._read_loop()
        finally:
            await self.detach_all()  # a closed socket detaches its streams, never cancels
            if self._closing:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(writer), 2.0)
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer

    def close(self, code: int, reason: str = "") -> None:
        """Close the socket with ``code`` after what is queued (or at once when full)."""
        if self._closing:
            return
        self._closing = True
        if self.queue.full():  # drop what a slow client has not read; it will resume
            self._drop_queued()
        self.queue.put_nowait(_Close(code, reason))

    async def _write_loop(self) -> None:
        try:
            while True:
                item = await self.queue.get()
                if item is _STOP:
                    return
                async with self._send_lock:
                    if not await self._write(item) or isinstance(item, _Close):
                        return
        finally:
            # nobody sends any more: release whoever waits on a full queue
            self._closing = True
            self._drop_queued()

    async def _write(self, item: str | _Close) -> bool:
        """Write one frame, or the close; False once the socket is gone (hold the lock)."""
        if self._dead:
            return False
        try:
            if isinstance(item, _Close):
                await self.ws.close(item.code, item.reason)
            else:
                await self.ws.send_text(item)
            return True
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass
        except Exception as exc:  # e.g. uvicorn's ClientDisconnected
            log.debug("websocket send failed: %r", exc)
        self._dead = self._closing = True
        self._drop_queued()  # what is queued will never be sent
        self.queue.put_nowait(_STOP)  # ends the writer if it waits for more
        return False

    def _drop_queued(self) -> None:
        """Empty the send queue (which also wakes producers waiting for room)."""
        while not self.queue.empty():
            self.queue.get_nowait()

    async def send(self, frame: dict[str, Any]) -> None:
        """Queue a frame for the writer (waits while the send queue is full).

        Never writes itself: the reader loop answers through here, and must go on
        reading (a ``cancel``, say) while a client that reads slowly holds up writes.
        """
        if frame.get("type") == "error":
            self.gw.metrics.count_error(frame.get("code", ErrorCode.INTERNAL), "ws")
        if not self._closing:
            await self.queue.put(p.encode(frame))

    async def send_token(self, sid: str, seq: int, text: str, logprobs: str | None) -> None:
        """A stream tail's ``token`` frame, encoded straight to text (the hot path)."""
        await self.send_encoded(p.encode_token(sid, seq, text, logprobs))

    async def send_encoded(self, text: str) -> None:
        """A stream tail's frame, already encoded with :mod:`tokenrelay.gateway.session.protocol`.

        Written at once when nothing is queued or being written, else queued for
        the writer (waits while the queue is full). Either way the tail waits
        while the client does not read: its stream is left in the log meanwhile.
        """
        if self._closing:
            return
        if self.queue.empty() and not self._send_lock.locked():
            async with self._send_lock:  # FIFO: behind a writer that already took a frame
                await self._write(text)
        else:
            await self.queue.put(text)

    async def _read_loop(self) -> None:
        while not self._closing:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            text = msg.get("text")
            if text is None:
                await self.send(
                    p.error_frame(ErrorCode.BAD_REQUEST, "binary frames are not supported")
                )
                continue
            if not self.rate.allow():
                if self.rate.abusive:
                    self.close(p.CLOSE_POLICY, "rate limit exceeded")
                    return
                await self.send(p.error_frame(ErrorCode.RATE_LIMITED, "too many frames; slow down"))
                continue
            await self.answer(functools.partial(p.parse_frame, text, self.gw.limits))


async def websocket_endpoint(ws: WebSocket) -> None:
    """Starlette endpoint for ``/v1/ws``."""
    gw: Gateway = ws.app.state.gateway
    address = ws.client.host if ws.client else "?"
    origin = ws.headers.get("origin")
    if not gw.guard.origins.allows(origin, ws.headers.get("host")):
        log.info("websocket origin refused", extra={"origin": (origin or "")[:200],
                                                    "client": address})  # fmt: skip
        await ws.close(p.CLOSE_POLICY)  # before accept: the handshake gets a 403
        return
    try:
        who = gw.guard.authenticate(ws.headers, ws.query_params, address)
    except AuthError as exc:
        await ws.accept()
        await ws.send_text(p.encode(p.error_frame(ErrorCode.UNAUTHORIZED, str(exc))))
        await ws.close(p.CLOSE_POLICY, "unauthorized")
        return
    conn = Connection(ws, gw)
    conn.principal = who
    gw.connections.add(conn)
    try:
        await conn.run()
    finally:
        gw.connections.discard(conn)
