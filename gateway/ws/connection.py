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
reference for the frames.

Long: the reader loop, the tails and the writer share the socket's queue, lock, slots
and attachments; apart, each would need all of that state passed in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from core.wire.errors import NO_SUCH_STREAM
from gateway.access.guard import AuthError, Principal, RateLimited, TooManyStreams
from gateway.streams.errors import STORE_ERRORS, refusal
from gateway.streams.store import RedisUnavailable, StreamForbidden, StreamNotFound
from gateway.ws import protocol as p

# what a new stream's tail says in its started frame: request id, resume token, choice (n > 1)
Started = tuple[str | None, str, int | None]

if TYPE_CHECKING:
    from gateway.state import Gateway

log = logging.getLogger("tokenrelay.ws")

RATE_PER_S = 50.0  # client frames per second, sustained
RATE_BURST = 200.0
MAX_VIOLATIONS = 200  # rate-limited frames (with no calm spell between) before closing: 1008


def _refused(
    exc: Exception, rid: str | None = None, sid: str | None = None, streaming: bool = False
) -> p.ProtocolError:
    """The ``error`` for a stream-store exception (gateway/streams/errors.py)."""
    r = refusal(exc, streaming=streaming)
    retry = r.retry_after
    return p.ProtocolError(r.code, r.message, request_id=rid, stream_id=sid, retry_after=retry)


class _Close:
    def __init__(self, code: int, reason: str = "") -> None:
        self.code, self.reason = code, reason


_STOP = _Close(0)  # queued for the writer to end without writing anything


class Connection:
    """One accepted WebSocket and the streams it carries."""

    def __init__(self, ws: WebSocket, gw: Gateway) -> None:
        self.ws = ws
        self.gw = gw
        self.queue: asyncio.Queue[str | _Close] = asyncio.Queue(gw.settings.send_queue)
        self.tails: dict[str, asyncio.Task[None]] = {}
        self.owned: set[str] = set()
        self.principal = Principal(None)  # set by websocket_endpoint
        self.slot_of: dict[str, str] = {}  # stream id -> --max-streams-per-key bucket
        self.attach_of: dict[str, str | None] = {}  # stream id -> attachment its tail holds
        self._tokens = RATE_BURST
        self._refilled = time.monotonic()
        self._violations = 0
        self._closing = False  # no new frames are taken (what is queued still goes)
        self._dead = False  # a write failed: nothing more can be sent
        self._send_lock = asyncio.Lock()  # one socket write at a time, in arrival order
        self.waiting_for_worker = False  # hello said no worker was ready: tell it when one is

    # --- lifecycle ---------------------------------------------------------------

    async def run(self) -> None:
        await self.ws.accept()
        writer = asyncio.create_task(self._write_loop(), name="ws-writer")
        try:
            if self.gw.shutting_down:
                self.close(p.CLOSE_GOING_AWAY, "gateway shutting down")
            elif len(self.gw.connections) > self.gw.settings.max_connections:
                self.close(p.CLOSE_OVERLOADED, "too many connections")
            else:
                hello = await self.gw.hello()
                await self.send(hello)
                self.waiting_for_worker = not hello["worker_ready"]  # a notice will follow
                await self._read_loop()
        finally:
            tails = list(self.tails.values())
            for task in tails:
                task.cancel()
            await asyncio.gather(*tails, return_exceptions=True)
            # a tail cancelled before it first ran never reached its `finally`
            left = self.slot_of.keys() | self.attach_of.keys()
            await asyncio.gather(*(self._release(sid) for sid in left))
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
            self.gw.metrics.count_error(frame.get("code", "internal"), "ws")
        if not self._closing:
            await self.queue.put(p.encode(frame))

    async def send_encoded(self, text: str) -> None:
        """A stream tail's frame, already encoded with :mod:`gateway.ws.protocol`.

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
                await self.send(p.error_frame("bad_request", "binary frames are not supported"))
                continue
            if not self._allow():
                self._violations += 1
                if self._violations >= MAX_VIOLATIONS:
                    self.close(p.CLOSE_POLICY, "rate limit exceeded")
                    return
                await self.send(p.error_frame("rate_limited", "too many frames; slow down"))
                continue
            if self._tokens >= RATE_BURST / 2:  # the client has calmed down
                self._violations = 0
            try:
                await self._handle(p.parse_frame(text, self.gw.limits))
            except p.ProtocolError as exc:
                refused = {"code": exc.code, "request_id": exc.request_id,
                           "stream_id": exc.stream_id, "reason": exc.message[:200]}  # fmt: skip
                log.info("frame refused", extra=refused)
                await self.send(exc.frame())
            except RedisUnavailable as exc:
                await self.send(_refused(exc).frame())
            except Exception:
                log.exception("frame handler failed")
                await self.send(p.error_frame("internal", "internal error"))

    def _allow(self) -> bool:
        now = time.monotonic()
        self._tokens = min(RATE_BURST, self._tokens + (now - self._refilled) * RATE_PER_S)
        self._refilled = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    # --- frames ----------------------------------------------------------------------

    async def _handle(self, frame: p.ClientFrame) -> None:
        if isinstance(frame, p.Ping):
            await self.send(p.pong_frame())
        elif isinstance(frame, p.Generate):
            await self._generate(frame)
        elif isinstance(frame, p.Resume):
            await self._resume(frame)
        elif isinstance(frame, p.Cancel):
            await self._cancel(frame)

    async def _generate(self, g: p.Generate) -> None:
        """One stream, or one per choice (``n``): each starts as soon as it is queued."""
        for index in range(g.n):
            await self._generate_one(g, index)

    async def _generate_one(self, g: p.Generate, index: int) -> None:
        rid = g.request_id
        bucket = self._open_slot(rid, None)
        created = False
        try:
            _, route = await self.gw.models.resolve(g.model)
            await self.gw.guard.admit(self.principal)
            new = await self.gw.streams.create(g.body(index), rid, model=route.model)
            created = True
        except RateLimited as exc:
            raise p.ProtocolError(
                "rate_limited", str(exc), request_id=rid, retry_after=exc.retry_after
            ) from None
        except STORE_ERRORS as exc:  # no worker, overloaded, Redis down
            raise _refused(exc, rid) from None
        finally:
            if not created:  # the slot goes back whatever went wrong
                self.gw.guard.close_stream(bucket)
        self.slot_of[new.stream_id] = bucket
        self.owned.add(new.stream_id)
        log.info("generate", extra={"request_id": rid, "stream_id": new.stream_id})
        started = (rid, new.resume_token, index if g.n > 1 else None)
        self._start_tail(new.stream_id, -1, new.attach_id, started)

    async def _resume(self, r: p.Resume) -> None:
        sid = r.stream_id
        try:
            info = await self.gw.streams.authorize(sid, r.resume_token)
            await self.gw.streams.check_after(sid, r.after)
        except STORE_ERRORS as exc:  # not found, forbidden, bad offset, Redis down
            raise _refused(exc, sid=sid) from None
        old = self.tails.pop(sid, None)
        if old is not None:  # one tail per stream per socket
            old.cancel()
            await asyncio.gather(old, return_exceptions=True)
            await self._release(sid)  # in case it was cancelled before it ran
        self.slot_of[sid] = self._open_slot(None, sid, new_tail=old is None)
        try:  # the slot and the attachment go back on every way out but a started tail
            attach_id = None
            if info.status != "done":
                with contextlib.suppress(RedisUnavailable):
                    attach_id = await self.gw.streams.attach(sid)
            self.attach_of[sid] = attach_id
            self.owned.add(sid)
            extra = {"stream_id": sid, "request_id": info.request_id, "after": r.after}
            log.info("resume", extra=extra)
            await self.send(p.resumed_frame(sid, r.after))
        except BaseException:  # cancelled meanwhile, say (the socket went away)
            await self._release(sid)
            raise
        self._start_tail(sid, r.after, attach_id, None)

    def _open_slot(self, rid: str | None, sid: str | None, new_tail: bool = True) -> str:
        """A ``--max-streams-per-key`` slot for a tail (one more on this socket: ``new_tail``)."""
        limit = self.gw.settings.max_streams_per_connection
        if new_tail and len(self.tails) >= limit:  # --max-streams-per-connection
            msg = f"at most {limit} concurrent streams per socket"
            raise p.ProtocolError("rate_limited", msg, request_id=rid, stream_id=sid)
        try:
            return self.gw.guard.open_stream(self.principal)
        except TooManyStreams as exc:
            raise p.ProtocolError(
                "rate_limited", str(exc), request_id=rid, stream_id=sid, retry_after=1
            ) from None

    async def _cancel(self, c: p.Cancel) -> None:
        sid = c.stream_id
        try:
            if sid not in self.owned:
                if c.resume_token is None:
                    info = await self.gw.streams.info(sid)
                    if info is None:
                        raise StreamNotFound(NO_SUCH_STREAM)
                    raise StreamForbidden(
                        "this socket did not start or resume the stream: send its resume_token"
                    )
                await self.gw.streams.authorize(sid, c.resume_token)
            outcome = await self.gw.streams.request_cancel(sid)
        except STORE_ERRORS as exc:  # not found, forbidden, Redis down
            raise _refused(exc, sid=sid) from None
        done = outcome.already_finished
        reason = outcome.info.finish_reason if done else None
        await self.send(p.cancelled_frame(sid, "finished" if done else "cancelling", reason))

    # --- tails -----------------------------------------------------------------------

    def _start_tail(
        self, sid: str, after: int, attach_id: str | None, started: Started | None
    ) -> None:
        self.attach_of[sid] = attach_id
        task = asyncio.create_task(self._tail(sid, after, started), name=f"tail-{sid}")
        self.tails[sid] = task

    async def _release(self, sid: str) -> None:
        """Give back a tail's per-key slot and remove its attachment (once per tail)."""
        bucket = self.slot_of.pop(sid, None)
        if bucket is not None:
            self.gw.guard.close_stream(bucket)
        if sid in self.attach_of:
            await self.gw.streams.detach(sid, self.attach_of.pop(sid))

    async def _tail(self, sid: str, after: int, started: Started | None) -> None:
        rid = started[0] if started else None
        try:
            tail = self.gw.streams.tail(sid, after, resumed=started is None)
            async with contextlib.aclosing(tail) as events:
                async for ev in events:
                    if ev.kind == "token":
                        await self.send_encoded(p.encode_token(sid, ev.seq, ev.text, ev.logprobs))
                    elif ev.kind == "done":
                        await self.send(
                            p.done_frame(
                                sid,
                                ev.seq,
                                ev.finish_reason or "error",
                                ev.prompt_tokens,
                                ev.completion_tokens,
                                ev.message,
                                ev.tool_calls,
                            )
                        )
                        return
                    elif started is not None and (ev.kind == "accepted" or ev.code == "cancelled"):
                        frame = p.started_frame(rid, sid, started[1], ev.prompt_tokens, started[2])
                        await self.send(frame)
                        started = None
                    elif started is not None and ev.kind == "rejected":
                        code = ev.code if ev.code in p.ERROR_CODES else "internal"
                        await self.send(
                            p.error_frame(code, ev.message or "rejected", request_id=rid)
                        )
                        return
        except (StreamNotFound, RedisUnavailable) as exc:  # expired/trimmed, or Redis is down
            await self.send(_refused(exc, rid, sid, streaming=True).frame())
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("stream tail failed", extra={"stream_id": sid, "request_id": rid})
            await self.send(p.error_frame("internal", "internal error", stream_id=sid))
        finally:
            if self.tails.get(sid) is asyncio.current_task():
                del self.tails[sid]
            await self._release(sid)


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
        await ws.send_text(p.encode(p.error_frame("unauthorized", str(exc))))
        await ws.close(p.CLOSE_POLICY, "unauthorized")
        return
    conn = Connection(ws, gw)
    conn.principal = who
    gw.connections.add(conn)
    try:
        await conn.run()
    finally:
        gw.connections.discard(conn)
