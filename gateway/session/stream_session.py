"""Protocol v1's streams on one client channel, whatever carries the frames.

A :class:`StreamSession` answers parsed client frames (gateway/session/protocol.py:
``generate``, ``resume``, ``cancel``, ``ping``) with server frames as dicts, and runs one
tail task per stream (replay + live events from the Redis log). A ``resume`` is admitted
as a ``generate`` is (a stream slot and a rate-limit request of the caller) and takes a
seat among its stream's readers (gateway/streams/readers.py); a reader a newer resume
replaces ends with ``forbidden``. A transport supplies
:meth:`StreamSession.send` (and, for a cheaper token frame, :meth:`StreamSession.send_token`).
The WebSocket's ``Connection`` (gateway/ws/connection.py) and the gRPC API's calls
(gateway/grpc/service.py) are the two. :class:`FrameRate` is the per-channel frame budget
both use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenrelay.core.wire.errors import NO_SUCH_STREAM, RequestError, as_code, lookup
from tokenrelay.core.wire.vocabulary import ErrorCode, EventKind, FinishReason, StreamStatus
from tokenrelay.gateway.access.guard import Principal
from tokenrelay.gateway.access.schema_pool import SCHEMAS
from tokenrelay.gateway.errors import (
    STORE_ERRORS,
    RateLimited,
    ReaderReplaced,
    RedisUnavailable,
    StreamForbidden,
    StreamNotFound,
    TooManyReaders,
    TooManyStreams,
    refusal,
)
from tokenrelay.gateway.session import protocol as p
from tokenrelay.gateway.streams.readers import REPLACED, Seat, StreamReaders

if TYPE_CHECKING:
    from tokenrelay.gateway.access.guard import Guard
    from tokenrelay.gateway.streams.routing import ModelDirectory
    from tokenrelay.gateway.streams.store import StreamStore

log = logging.getLogger("tokenrelay.session")

# what a new stream's tail says in its started frame: request id, resume token, choice (n > 1)
Started = tuple[str | None, str, int | None]

RATE_PER_S = 50.0  # client frames per second, sustained
RATE_BURST = 200.0
MAX_VIOLATIONS = 200  # rate-limited frames (with no calm spell between) before the channel ends
REPLACED_SEND_WAIT = 2.0  # seconds a replaced reader's error frame may wait for room


def refused(
    exc: BaseException, rid: str | None = None, sid: str | None = None, streaming: bool = False
) -> p.ProtocolError:
    """The ``error`` for a stream-store exception (gateway/errors.py)."""
    r = refusal(exc, streaming=streaming)
    retry = r.retry_after
    return p.ProtocolError(r.code, r.message, request_id=rid, stream_id=sid, retry_after=retry)


def _schema_refused(frame: p.ClientFrame, exc: RequestError) -> p.ProtocolError:
    """The ``error`` of a frame whose schema was refused, or came to a busy pool."""
    rid = getattr(frame, "request_id", None)
    return p.ProtocolError(exc.code, exc.message, request_id=rid,
                           retry_after=lookup(exc.code).retry_after)  # fmt: skip


class FrameRate:
    """A token bucket of client frames: ``RATE_PER_S`` sustained, ``RATE_BURST`` at once."""

    def __init__(self) -> None:
        self._tokens = RATE_BURST
        self._refilled = time.monotonic()
        self.violations = 0  # refused frames since the client last calmed down

    def allow(self) -> bool:
        """Take one frame's token; False (one violation more) when there is none."""
        now = time.monotonic()
        self._tokens = min(RATE_BURST, self._tokens + (now - self._refilled) * RATE_PER_S)
        self._refilled = now
        if self._tokens < 1:
            self.violations += 1
            return False
        self._tokens -= 1
        if self._tokens >= RATE_BURST / 2:  # the client has calmed down
            self.violations = 0
        return True

    @property
    def abusive(self) -> bool:
        """The client kept sending while refused: end the channel (policy)."""
        return self.violations >= MAX_VIOLATIONS


@dataclass(frozen=True)
class SessionParts:
    """What a session uses of its gateway: the stream store, the guard, model routing, the
    resumes reading each stream."""

    streams: StreamStore
    guard: Guard
    models: ModelDirectory
    max_streams: int  # --max-streams-per-connection
    readers: StreamReaders = field(default_factory=StreamReaders)  # --max-resumes-per-stream


class StreamSession:
    """The streams one client channel carries; subclasses deliver the frames."""

    transport = "?"  # the metrics label of this channel's errors
    channel = "channel"  # what errors call it ("socket", "call")

    def __init__(self, parts: SessionParts, principal: Principal) -> None:
        self.parts = parts
        self.principal = principal
        self.tails: dict[str, asyncio.Task[None]] = {}
        self.owned: set[str] = set()  # streams this channel started or resumed
        self.slot_of: dict[str, str] = {}  # stream id -> --max-streams-per-key bucket
        self.attach_of: dict[str, str | None] = {}  # stream id -> attachment its tail holds
        self.seat_of: dict[str, Seat] = {}  # stream id -> its resume's seat (readers.py)
        self.waiting_for_worker = False  # hello said no worker was ready: tell it when one is

    # --- what a transport supplies ---------------------------------------------------

    async def send(self, frame: dict[str, Any]) -> None:
        """Deliver one server frame (waits while the client does not read)."""
        raise NotImplementedError

    async def send_token(self, sid: str, seq: int, text: str, logprobs: str | None) -> None:
        """Deliver a ``token`` frame (``logprobs``: the event's stored ``l`` field)."""
        await self.send(p.token_frame(sid, seq, text, logprobs))

    # --- frames ------------------------------------------------------------------------

    async def answer(self, parse: Callable[[], p.ClientFrame]) -> None:
        """Parse one client frame and handle it; every failure becomes an ``error`` frame.

        Its JSON schemas are checked off the loop (gateway/access/schema_pool.py).
        """
        try:
            await self.handle(await SCHEMAS.parse(parse, _schema_refused))
        except p.ProtocolError as exc:
            refused_ = {"code": exc.code, "request_id": exc.request_id,
                        "stream_id": exc.stream_id, "reason": exc.message[:200],
                        "transport": self.transport}  # fmt: skip
            log.info("frame refused", extra=refused_)
            await self.send(exc.frame())
        except RedisUnavailable as exc:
            await self.send(refused(exc).frame())
        except Exception:
            log.exception("frame handler failed", extra={"transport": self.transport})
            await self.send(p.error_frame(ErrorCode.INTERNAL, "internal error"))

    async def handle(self, frame: p.ClientFrame) -> None:
        """Answer one parsed frame; raises :class:`~gateway.session.protocol.ProtocolError`."""
        if isinstance(frame, p.Ping):
            await self.send(p.pong_frame())
        elif isinstance(frame, p.Generate):
            for index in range(frame.n):  # one stream per choice, each started when queued
                await self._generate_one(frame, index)
        elif isinstance(frame, p.Resume):
            await self._resume(frame)
        elif isinstance(frame, p.Cancel):
            await self._cancel(frame)

    async def _generate_one(self, g: p.Generate, index: int) -> None:
        rid = g.request_id
        bucket = self._open_slot(rid, None)
        created = False
        try:
            _, route = await self.parts.models.resolve(g.model)
            await self._admit(rid, None)
            new = await self.parts.streams.create(
                g.body(index),
                rid,
                model=route.model,
                traceparent=g.traceparent,
                detach_timeout=g.detach_timeout,
                owner=self.parts.guard.log_owner(self.principal),
            )
            created = True
        except STORE_ERRORS as exc:  # no worker, overloaded, Redis down, unknown model
            raise refused(exc, rid) from None
        finally:
            if not created:  # the slot goes back whatever went wrong
                self.parts.guard.close_stream(bucket)
        self.slot_of[new.stream_id] = bucket
        self.owned.add(new.stream_id)
        extra = {"request_id": rid, "stream_id": new.stream_id, "transport": self.transport}
        log.info("generate", extra=extra)
        started = (rid, new.resume_token, index if g.n > 1 else None)
        self._start_tail(new.stream_id, -1, new.attach_id, started)

    async def _resume(self, r: p.Resume) -> None:
        sid = r.stream_id
        try:
            info = await self.parts.streams.authorize(sid, r.resume_token)
            await self.parts.streams.check_after(sid, r.after)
        except STORE_ERRORS as exc:  # not found, forbidden, bad offset, Redis down
            raise refused(exc, sid=sid) from None
        old = self.tails.pop(sid, None)
        if old is not None:  # one tail per stream per channel
            old.cancel()
            await asyncio.gather(old, return_exceptions=True)
            await self.release(sid)  # in case it was cancelled before it ran
        self.slot_of[sid] = self._open_slot(None, sid, new_tail=old is None)
        try:  # slot, seat and attachment go back on every way out but a started tail
            await self._admit(None, sid)  # a resume is admitted as a new stream is
            seat = self._take_seat(sid)
            attach_id = None
            if info.status != StreamStatus.DONE:
                with contextlib.suppress(RedisUnavailable):
                    attach_id = await self.parts.streams.attach(sid)
            self.attach_of[sid] = attach_id
            self.owned.add(sid)
            extra = {"stream_id": sid, "request_id": info.request_id, "after": r.after,
                     "transport": self.transport}  # fmt: skip
            log.info("resume", extra=extra)
            await self.send(p.resumed_frame(sid, r.after))
            if seat.replaced:  # a newer resume took the seat meanwhile
                raise refused(ReaderReplaced(REPLACED), sid=sid)
        except BaseException:  # cancelled meanwhile, say (the channel went away)
            await self.release(sid)
            raise
        self._start_tail(sid, r.after, attach_id, None)

    async def _admit(self, rid: str | None, sid: str | None) -> None:
        """Spend a request of the caller's rate limit (``--rate-limit``, per address)."""
        try:
            await self.parts.guard.admit(self.principal)
        except RateLimited as exc:
            raise p.ProtocolError(ErrorCode.RATE_LIMITED, str(exc), request_id=rid,
                                  stream_id=sid, retry_after=exc.retry_after) from None  # fmt: skip

    def _take_seat(self, sid: str) -> Seat:
        """A seat among the resumes reading ``sid`` (``--max-resumes-per-stream``)."""
        try:
            seat = self.parts.readers.take(sid, lambda: self._replaced(sid))
        except TooManyReaders as exc:
            raise refused(exc, sid=sid) from None
        self.seat_of[sid] = seat
        return seat

    def _replaced(self, sid: str) -> None:
        """A newer resume took this channel's seat of ``sid``: end its tail, which says so."""
        seat, task = self.seat_of.get(sid), self.tails.get(sid)
        if seat is not None and seat.replaced and task is not None:
            task.cancel()

    def _open_slot(self, rid: str | None, sid: str | None, new_tail: bool = True) -> str:
        """A ``--max-streams-per-key`` slot for a tail (one more here: ``new_tail``)."""
        limit = self.parts.max_streams
        if new_tail and len(self.tails) >= limit:  # --max-streams-per-connection
            msg = f"at most {limit} concurrent streams per {self.channel}"
            raise p.ProtocolError(ErrorCode.RATE_LIMITED, msg, request_id=rid, stream_id=sid)
        try:
            return self.parts.guard.open_stream(self.principal)
        except TooManyStreams as exc:
            raise p.ProtocolError(
                ErrorCode.RATE_LIMITED, str(exc), request_id=rid, stream_id=sid, retry_after=1
            ) from None

    async def _cancel(self, c: p.Cancel) -> None:
        sid = c.stream_id
        try:
            if sid not in self.owned:
                if c.resume_token is None:
                    info = await self.parts.streams.info(sid)
                    if info is None:
                        raise StreamNotFound(NO_SUCH_STREAM)
                    raise StreamForbidden(
                        f"this {self.channel} did not start or resume the stream: "
                        "send its resume_token"
                    )
                await self.parts.streams.authorize(sid, c.resume_token)
            outcome = await self.parts.streams.request_cancel(sid)
        except STORE_ERRORS as exc:  # not found, forbidden, Redis down
            raise refused(exc, sid=sid) from None
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

    async def release(self, sid: str) -> None:
        """Give back a tail's per-key slot and seat, remove its attachment (once per tail)."""
        bucket = self.slot_of.pop(sid, None)
        if bucket is not None:
            self.parts.guard.close_stream(bucket)
        self.parts.readers.leave(self.seat_of.pop(sid, None))
        if sid in self.attach_of:
            await self.parts.streams.detach(sid, self.attach_of.pop(sid))

    async def detach_all(self) -> None:
        """The channel is gone: stop every tail and detach its streams (never a cancel)."""
        tails = list(self.tails.values())
        for task in tails:
            task.cancel()
        await asyncio.gather(*tails, return_exceptions=True)
        # a tail cancelled before it first ran never reached its `finally`
        left = self.slot_of.keys() | self.attach_of.keys() | self.seat_of.keys()
        await asyncio.gather(*(self.release(sid) for sid in left))

    async def _tail(self, sid: str, after: int, started: Started | None) -> None:
        seat = self.seat_of.get(sid)
        try:
            await tail_frames(self.parts.streams, sid, after, started, self.send, self.send_token)
        except asyncio.CancelledError:
            if seat is None or not seat.replaced:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # cancelled by the replacement, not by whoever awaits the tail
            frame = refused(ReaderReplaced(REPLACED), sid=sid).frame()
            with contextlib.suppress(asyncio.TimeoutError):  # a half-open socket: no room
                await asyncio.wait_for(self.send(frame), REPLACED_SEND_WAIT)
        finally:
            if self.tails.get(sid) is asyncio.current_task():
                del self.tails[sid]
            await self.release(sid)


async def tail_frames(
    streams: StreamStore,
    sid: str,
    after: int,
    started: Started | None,
    send: Callable[[dict[str, Any]], Awaitable[None]],
    send_token: Callable[[str, int, str, str | None], Awaitable[None]],
) -> None:
    """Send one stream's events with seq > ``after`` as protocol v1 frames, until ``done``.

    ``started`` (a new stream): its ``started`` frame once a worker accepted it (or an
    ``error`` with the request id when the worker refused it). A stream that expires or
    an outage ends with an ``error`` frame naming the stream; a bug with ``internal``.
    """
    rid = started[0] if started else None
    try:
        tail = streams.tail(sid, after, resumed=started is None)
        async with contextlib.aclosing(tail) as events:
            async for ev in events:
                if ev.kind == EventKind.TOKEN and ev.call_deltas:
                    await send(p.token_frame(sid, ev.seq, ev.shown, ev.logprobs, ev.call_deltas))
                elif ev.kind == EventKind.TOKEN:
                    await send_token(sid, ev.seq, ev.shown, ev.logprobs)
                elif ev.kind == EventKind.DONE:
                    reason = ev.finish_reason or FinishReason.ERROR
                    await send(p.done_frame(sid, ev.seq, reason, ev.prompt_tokens,
                                            ev.completion_tokens, ev.message,
                                            ev.tool_calls))  # fmt: skip
                    return
                elif started is not None and (
                    ev.kind == EventKind.ACCEPTED or ev.code == FinishReason.CANCELLED
                ):
                    await send(p.started_frame(rid, sid, started[1], ev.prompt_tokens, started[2]))
                    started = None
                elif started is not None and ev.kind == EventKind.REJECTED:
                    code = as_code(ev.code)
                    await send(p.error_frame(code, ev.message or "rejected", request_id=rid))
                    return
    except (StreamNotFound, RedisUnavailable) as exc:  # expired/trimmed, or Redis is down
        await send(refused(exc, rid, sid, streaming=True).frame())
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("stream tail failed", extra={"stream_id": sid, "request_id": rid})
        await send(p.error_frame(ErrorCode.INTERNAL, "internal error", stream_id=sid))
