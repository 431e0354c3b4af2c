"""The Redis stream log as gateways see it, independent of the transport.

The WebSocket and the SSE API both go through :class:`StreamStore`: create a
stream (and queue its request for the engine workers), authorise a client
with the resume token, replay events after an offset and tail live ones with
no gap and no duplicate, cancel, and keep attachments alive so the worker
knows whether anyone is still listening. core/wire/keys.py has the key
layout; gateway/streams/tailer.py serves the live part.

With ``--otlp-endpoint`` it is also where the gateway traces (core/tracing.py): the
receive and enqueue spans in :meth:`StreamStore.create`, one span per client
attachment in :meth:`StreamStore.tail`, which also keeps the delivery-latency histogram.

Long: it is the one façade every transport calls, and each method is a few
Redis calls with its error handling; split, the pieces would share all their
state (client, keys, attachments, counters) through the class anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from tokenrelay.core.redis.connection import (
    RedisHealth,
    atomic_pipeline,
    connect_async,
    is_full,
    is_outage,
    raise_if_cancel_swallowed,
)
from tokenrelay.core.tracing import DEFAULT_CLIENT_TRACE, edge_context
from tokenrelay.core.wire.events import Event, decode_event, entry_id, plan_finish, seq_of
from tokenrelay.core.wire.ids import hash_token, new_resume_token, new_stream_id, token_matches
from tokenrelay.core.wire.keys import (
    ACTIVE_TTL,
    CONTROL_MAXLEN,
    DEFAULT_PREFIX,
    GROUP,
    MAXLEN,
    Keys,
)
from tokenrelay.core.wire.records import MetaField, QueuedRequest, StreamMeta
from tokenrelay.core.wire.scripts import (
    APPEND_LUA,
    BUCKET_LUA,
    COUNT_LUA,
    Append,
    append_call,
    decode_append,
)
from tokenrelay.core.wire.stats import STATS_FIELD, WorkerStats
from tokenrelay.core.wire.telemetry import (
    DELIVERY_BUCKETS,
    DISCONNECTS_FIELD,
    RESUMES_FIELD,
    TRACE_FIELD,
    Hist,
    log_summary,
)
from tokenrelay.core.wire.vocabulary import EventKind, FinishReason, StreamStatus
from tokenrelay.gateway.errors import (
    BadOffset,
    EventsTrimmed,
    NoWorker,
    Overloaded,
    RedisFull,
    RedisUnavailable,
    ShuttingDown,
    StreamForbidden,
    StreamNotFound,
)
from tokenrelay.gateway.streams.attachments import Attachments
from tokenrelay.gateway.streams.ledger import LogLedger
from tokenrelay.gateway.streams.memory import ADMIT_BELOW, MemoryGauge
from tokenrelay.gateway.streams.tailer import Tailer

if TYPE_CHECKING:
    from tokenrelay.core.tracing import Tracing

log = logging.getLogger("tokenrelay.streamlog")

__all__ = [
    "CancelOutcome",
    "NewStream",
    "StreamStore",
]

REPLAY_PAGE = 256
CREATE_TRIES = 3  # attempts to create a stream on a cluster with a master down
T = TypeVar("T")


@dataclass(frozen=True)
class CancelOutcome:
    """``already_finished``: the stream had ended before this cancel; ``info``: its metadata now."""

    already_finished: bool
    info: StreamMeta


@dataclass(frozen=True)
class NewStream:
    stream_id: str
    resume_token: str
    attach_id: str | None


def _str(raw: Any) -> str | None:
    return raw.decode() if isinstance(raw, bytes) else raw


class StreamStore:
    """Gateway-side access to the stream log in Redis (one per process)."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        stream_ttl: float = 3600.0,
        detach_timeout: float = 30.0,
        max_pending: int = 4096,
        name: str = "gateway",
        admit_memory: float | None = ADMIT_BELOW,
        cluster: bool = False,
    ) -> None:
        self.keys = Keys(prefix, cluster=cluster)
        self.stream_ttl = stream_ttl
        self.detach_timeout = detach_timeout
        self.max_pending = max_pending
        self.gateway_id = f"{name}-{os.getpid()}-{secrets.token_hex(3)}"
        self.redis = connect_async(url, cluster=cluster)
        self.health = RedisHealth(name)
        self.tailer = Tailer(url, self.keys, self.redis, self.health, self._end_abandoned)
        self._append = self.redis.register_script(APPEND_LUA)
        self.attachments = Attachments(self.redis, self.keys, self.gateway_id, self._guard)
        self._workers_cache: tuple[float, list[str]] = (0.0, [])
        self._count = self.redis.register_script(COUNT_LUA)
        self._bucket = self.redis.register_script(BUCKET_LUA)
        self.memory = MemoryGauge(self.redis, self._guard, admit_below=admit_memory)
        # --max-log-bytes-per-key (set by gateway/state.py: ledger.limit)
        self.ledger = LogLedger(self.redis, self.keys, self._guard)
        self.accepting = True  # False while the gateway drains
        # this process's totals, exported by gateway/observe/metrics.py
        self.resumes = 0
        self.events_replayed = 0
        self.cancels = 0
        self.disconnects = 0
        # worker append -> handed to the client's socket, live events only (a histogram)
        self.delivery = Hist(DELIVERY_BUCKETS)
        self.tracing: Tracing | None = None  # --otlp-endpoint (set by gateway/state.py)
        self.client_trace = DEFAULT_CLIENT_TRACE  # --client-traceparent (the same)

    async def start(self) -> None:
        self.tailer.start()
        self.attachments.start()

    async def close(self) -> None:
        await self.attachments.close()
        await self.tailer.close()
        await self.redis.aclose()

    async def _guard(self, aw: Awaitable[T]) -> T:
        """Await a Redis call; outages become :class:`RedisUnavailable`, a full Redis
        :class:`RedisFull` (not an outage for :attr:`health`: reads still work)."""
        try:
            out = await aw
        except Exception as exc:
            if is_full(exc):
                raise RedisFull("redis is full (maxmemory)") from None
            if is_outage(exc):
                self.health.failed(exc)
                raise RedisUnavailable("redis is unreachable") from None
            raise
        self.health.ok()
        return out

    # --- health ----------------------------------------------------------------

    async def ping(self) -> bool:
        try:
            return bool(await self._guard(self.redis.ping()))
        except RedisUnavailable:
            return False

    async def live_workers(self, *, max_age: float = 1.0) -> list[str]:
        """Ids of engine workers whose heartbeat is current (cached ``max_age`` s)."""
        at, cached = self._workers_cache
        if time.monotonic() - at < max_age:
            return cached
        members = sorted(
            _str(m) or "" for m in await self._guard(self.redis.smembers(self.keys.workers))
        )
        pipe = self.redis.pipeline(transaction=False)
        for w in members:
            pipe.exists(self.keys.worker(w))
        alive = [w for w, up in zip(members, await self._guard(pipe.execute()), strict=True) if up]
        self._workers_cache = (time.monotonic(), alive)
        return alive

    async def queue_depth(self, models: list[str | None]) -> int | None:
        """Requests waiting on the queues of ``models`` (queued, not yet taken by a worker);
        ``None`` when no queue could be read."""
        queues = [q for m in models for q in self.keys.queue_shards(m)]
        pipe = self.redis.pipeline(transaction=False)
        for queue in queues:
            pipe.xlen(queue)
            pipe.xpending(queue, GROUP)
        replies = await self._guard(pipe.execute(raise_on_error=False))
        depth = None
        for length, pending in zip(replies[0::2], replies[1::2], strict=True):
            if isinstance(length, int):
                taken = pending.get("pending", 0) if isinstance(pending, dict) else 0
                depth = (depth or 0) + max(0, length - int(taken or 0))
        return depth

    async def draw_tokens(
        self, bucket: str, capacity: int, per_ms: float, cost: int
    ) -> tuple[bool, float, int]:
        """Draw ``cost`` tokens from a rate limit's bucket (Redis' clock, all gateways):
        ``(allowed, seconds until allowed, tokens left)``."""
        keys = [self.keys.rate_bucket(bucket)]
        args: list[int | str] = [capacity, repr(per_ms), cost]
        allowed, wait_ms, left = await self._guard(self._bucket(keys=keys, args=args))
        return bool(allowed), int(wait_ms) / 1000.0, int(left)

    async def meta_field(self, stream_id: str, name: str) -> str | None:
        """One field of a stream's metadata hash (``RedisUnavailable`` when Redis is down)."""
        return _str(await self._guard(self.redis.hget(self.keys.meta(stream_id), name)))

    async def set_meta_field(self, stream_id: str, name: str, value: str) -> None:
        """Set one field of a stream's metadata hash (a transport's own, such as its format)."""
        await self._guard(self.redis.hset(self.keys.meta(stream_id), name, value))

    async def worker_stats(self, workers: list[str]) -> list[WorkerStats | None]:
        """Each worker's last published stats (``None`` where there are none)."""
        pipe = self.redis.pipeline(transaction=False)
        for w in workers:
            pipe.hget(self.keys.worker(w), STATS_FIELD)
        return [WorkerStats.from_json(raw) for raw in await self._guard(pipe.execute())]

    async def workers_draining(self, workers: list[str]) -> list[bool]:
        """For each worker, whether its last published stats say it is draining (SIGTERM)."""
        return [s is not None and s.draining for s in await self.worker_stats(workers)]

    # --- streams -----------------------------------------------------------------

    async def create(
        self,
        body: dict[str, Any],
        request_id: str | None,
        *,
        attach: bool = True,
        model: str | None = None,
        traceparent: str | None = None,
        received_ns: int | None = None,
        detach_timeout: float | None = None,
        owner: str | None = None,
    ) -> NewStream:
        """Create a stream and queue its request for ``model`` (gateway/streams/routing.py;
        ``None``: on ``P requests``, for workers that name no model).

        ``detach_timeout``: the seconds the request asked its stream to keep generating
        with no client attached (checked by the transport against ``--max-detach-timeout``);
        ``None``: this gateway's ``--detach-timeout``. It goes into the request record.
        ``owner``: whose ledger counts the stream's log bytes (``Guard.log_owner``; None:
        nobody's), refused with :class:`LogBytesFull` over ``--max-log-bytes-per-key``.

        With tracing on, the ``gateway.receive`` span (from ``received_ns``, epoch ns, when
        the transport took the time; the client's ``traceparent`` is its parent, a link or
        nothing, by :attr:`client_trace`: core/tracing.py's ``edge_context``) and its child
        ``gateway.enqueue`` (this call) are recorded; the request entry carries the
        enqueue span's context to the worker.
        Raises :class:`Overloaded` or :class:`RedisFull` (Redis is at ``admit_memory`` of
        its maxmemory, or refused the write), :class:`NoWorker`, :class:`RedisUnavailable`.
        """
        dt = self.detach_timeout if detach_timeout is None else detach_timeout
        if self.tracing is None:
            return await self._create(body, request_id, attach, model, dt, None, owner)
        attrs = {"tokenrelay.request_id": request_id, "tokenrelay.model": model}
        parent, links = edge_context(traceparent, self.client_trace)
        receive = self.tracing.start(
            "gateway.receive",
            parent,
            start_ns=received_ns,
            kind="server",
            attributes=attrs,
            links=links,
        )
        enqueue = self.tracing.start("gateway.enqueue", receive.traceparent, kind="producer")
        try:
            new = await self._create(
                body,
                request_id,
                attach,
                model,
                dt,
                (receive.traceparent, enqueue.traceparent),
                owner,
            )
        except Exception as exc:
            enqueue.fail(type(exc).__name__)
            receive.fail(type(exc).__name__)
            raise
        else:
            receive.set({"tokenrelay.stream_id": new.stream_id})
        finally:
            enqueue.end()
            receive.end()
        return new

    async def _create(
        self,
        body: dict[str, Any],
        request_id: str | None,
        attach: bool,
        model: str | None,
        detach_timeout: float,
        trace: tuple[str, str] | None,  # traceparents: the stream's (receive), the worker's
        owner: str | None,
    ) -> NewStream:
        """:meth:`_create_once`; on a cluster, again (a new stream id, another queue shard)
        while the master of the stream's keys or of its shard is down, up to CREATE_TRIES
        times: a stream can be created while any master answers."""
        args = (body, request_id, attach, model, detach_timeout, trace, owner)
        for attempt in range(CREATE_TRIES if self.keys.cluster else 1):
            try:
                return await self._create_once(*args)
            except RedisUnavailable:
                if not self.keys.cluster or attempt == CREATE_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    async def _create_once(
        self,
        body: dict[str, Any],
        request_id: str | None,
        attach: bool,
        model: str | None,
        detach_timeout: float,
        trace: tuple[str, str] | None,
        owner: str | None,
    ) -> NewStream:
        if not self.accepting:
            raise ShuttingDown("this gateway is shutting down; retry (another gateway will answer)")
        if not await self.live_workers():
            raise NoWorker("no engine worker is running")
        shards = self.keys.queue_shards(model)  # one, or a cluster's: any, at random
        shard = random.randrange(len(shards))
        queue = shards[shard]
        if await self._guard(self.redis.xlen(queue)) >= math.ceil(self.max_pending / len(shards)):
            raise Overloaded("too many requests are waiting")
        if await self.memory.full():  # the room left is for the streams already running
            raise RedisFull("redis is nearly full (maxmemory)")
        sid, token = new_stream_id(), new_resume_token()
        counted = await self.ledger.reserve(owner, sid, body.get("params") or {})
        ledger = owner if counted else None
        try:
            return await self._write(sid, token, body, request_id, attach, model, queue, shard,
                                     detach_timeout, trace, ledger)  # fmt: skip
        except BaseException:
            if ledger is not None:  # no stream: no bytes to count
                await self.ledger.release(ledger, sid)
            raise

    async def _write(
        self,
        sid: str,
        token: str,
        body: dict[str, Any],
        request_id: str | None,
        attach: bool,
        model: str | None,
        queue: str,
        shard: int,
        detach_timeout: float,
        trace: tuple[str, str] | None,
        owner: str | None,  # whose ledger counts the log (a reservation made)
    ) -> NewStream:
        """Write a new stream's metadata and attachment, and queue its request."""
        attach_id = self.attachments.new_id() if attach else None
        meta = StreamMeta.new_fields(
            hash_token(token),
            request_id,
            int(time.time() * 1000),
            self.gateway_id,
            self.stream_ttl,
            None if trace is None else trace[0],
        )
        if owner is not None:
            meta[MetaField.LOG_OWNER] = owner
        pipe = atomic_pipeline(self.redis)
        pipe.hset(self.keys.meta(sid), mapping=meta)
        pipe.expire(self.keys.meta(sid), int(ACTIVE_TTL))
        if attach_id:
            self.attachments.queue(pipe, sid, attach_id)
        request = QueuedRequest(
            stream_id=sid,
            request_id=request_id,
            body={**body, "model": model} if model else body,
            detach_timeout=detach_timeout,
            stream_ttl=self.stream_ttl,
            traceparent=None if trace is None else trace[1],
        ).encode()
        if self.keys.cluster:
            # The metadata must be there before a worker can take the request: a cluster
            # pipeline sends to each master at once, so it is a round trip of its own.
            await self._guard(pipe.execute())
            await self._guard(self.redis.xadd(queue, request))  # type: ignore[arg-type]
            await self._wake(self.keys.wakes(model)[shard])
        else:
            pipe.xadd(queue, request)  # type: ignore[arg-type]
            await self._guard(pipe.execute())
        if attach_id:
            self.attachments.track(sid, attach_id)
        log.debug("stream created", extra={"stream_id": sid, "request_id": request_id})
        return NewStream(sid, token, attach_id)

    async def _wake(self, channel: str) -> None:
        """Wake an idle worker on the wake ``channel`` of the queue shard just written (a
        cluster's queue has no blocking read), best effort once the request is queued: a
        request whose wake-up is lost still runs (workers sweep their queues every wait,
        worker/shards.py)."""
        try:
            await self.redis.spublish(channel, "1")  # type: ignore[attr-defined]
        except Exception as exc:
            if not is_outage(exc):
                raise
            log.debug("wake-up not published: %r", exc)

    async def info(self, stream_id: str) -> StreamMeta | None:
        """The stream's metadata, or None for an unknown or expired stream."""
        raw: Any = await self._guard(self.redis.hgetall(self.keys.meta(stream_id)))
        return StreamMeta.decode(stream_id, raw or {}, self.stream_ttl)

    async def authorize(self, stream_id: str, resume_token: str) -> StreamMeta:
        """Metadata of a stream the token opens; raises NotFound/Forbidden."""
        info = await self.info(stream_id)
        if info is None:
            raise StreamNotFound("no such stream (unknown or expired)")
        if not token_matches(resume_token, info.token_hash):
            raise StreamForbidden("resume_token does not match this stream")
        return info

    async def last_seq(self, stream_id: str) -> int:
        """Seq of the newest event (-1 when the log is empty)."""
        top: Any = await self._guard(self.redis.xrevrange(self.keys.stream(stream_id), count=1))
        return seq_of(top[0][0]) if top else -1

    async def check_after(self, stream_id: str, after: int) -> None:
        """Raise :class:`BadOffset` when ``after`` is past the newest event."""
        last = max(0, await self.last_seq(stream_id))
        if after > last:
            raise BadOffset(f"after={after} is beyond the last event (seq {last})")

    async def read(self, stream_id: str, after: int, count: int = REPLAY_PAGE) -> list[Event]:
        """Events with seq > ``after`` (at most ``count``), oldest first."""
        raw: Any = await self._guard(
            self.redis.xrange(self.keys.stream(stream_id), min=entry_id(after + 1), count=count)
        )
        return [decode_event(eid, fields) for eid, fields in raw]

    def tail(
        self, stream_id: str, after: int, *, resumed: bool = False
    ) -> AsyncGenerator[Event, None]:
        """Every event with seq > ``after``: the replay, then live ones, until ``done``.

        ``after`` = -1 includes the seq-0 ``accepted``/``rejected`` marker.
        ``resumed``: a client resumes the stream (counted, with the events
        replayed, in the metrics and the stream's summary line).
        Raises :class:`EventsTrimmed`, :class:`StreamNotFound` (expired while
        waiting) or :class:`RedisUnavailable`. With tracing on, the attachment is one
        ``gateway.deliver`` (``gateway.resume``) span in the stream's trace.
        """
        if self.tracing is None:
            return self._tail(stream_id, after, resumed)
        return self._traced_tail(self.tracing, stream_id, after, resumed)

    async def _traced_tail(
        self, tracing: Tracing, stream_id: str, after: int, resumed: bool
    ) -> AsyncGenerator[Event, None]:
        parent = None
        with contextlib.suppress(RedisUnavailable):  # the trace is best effort
            raw = await self._guard(self.redis.hget(self.keys.meta(stream_id), TRACE_FIELD))
            parent = _str(raw)
        attrs = {"tokenrelay.stream_id": stream_id, "tokenrelay.after": after}
        name = "gateway.resume" if resumed else "gateway.deliver"
        span = tracing.start(name, parent, kind="producer", attributes=attrs)
        last, count = after, 0
        try:
            async with contextlib.aclosing(self._tail(stream_id, after, resumed)) as events:
                async for ev in events:
                    last, count = ev.seq, count + 1
                    yield ev
        except (GeneratorExit, asyncio.CancelledError):
            raise  # the client went, or took the done event and stopped reading
        except BaseException as exc:
            span.fail(type(exc).__name__)
            raise
        finally:
            span.set({"tokenrelay.last_seq": last, "tokenrelay.events": count})
            span.end()

    async def _tail(self, stream_id: str, after: int, resumed: bool) -> AsyncGenerator[Event, None]:
        last = after
        if resumed:
            self.resumes += 1
            await self._count_field(stream_id, RESUMES_FIELD)
        while True:
            page = await self.read(stream_id, last, REPLAY_PAGE)
            # a consumer cancelled during the read must not go on to subscribe and wait
            # for the stream's end (its socket may be long gone)
            raise_if_cancel_swallowed()
            if page and last >= 0 and page[0].seq != last + 1:
                raise EventsTrimmed(f"events after seq {last} are no longer kept")
            for ev in page:
                if resumed:
                    self.events_replayed += 1
                yield ev
                last = ev.seq
                if ev.kind == EventKind.DONE:
                    return
            if len(page) < REPLAY_PAGE:
                break
        sub = self.tailer.subscribe(stream_id, last)
        delivery = self.delivery
        try:
            while True:
                events = await sub.get()
                appended, sub.appended = sub.appended, None  # a live batch's append time
                for ev in events:
                    yield ev
                    if ev.kind == EventKind.DONE:
                        return
                    if appended is not None:  # its first event is out: delivered
                        delivery.observe(time.time() - appended)
                        appended = None
        finally:
            self.tailer.unsubscribe(sub)

    async def cancel(self, stream_id: str) -> StreamMeta:
        """Ask the engine to stop the stream (idempotent); returns its metadata now."""
        return (await self.request_cancel(stream_id)).info

    async def request_cancel(self, stream_id: str) -> CancelOutcome:
        """Ask the engine to stop the stream (idempotent); says whether it had already ended."""
        info = await self.info(stream_id)
        if info is None:
            raise StreamNotFound("no such stream (unknown or expired)")
        if info.status == StreamStatus.DONE:
            return CancelOutcome(True, info)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.meta(stream_id), MetaField.CANCEL, "1")
        pipe.xadd(self.keys.control, {"cancel": stream_id}, maxlen=CONTROL_MAXLEN, approximate=True)
        await self._guard(pipe.execute())
        self.cancels += 1
        if info.status == StreamStatus.QUEUED:  # no worker has it yet: end it here
            await self.finish(stream_id, FinishReason.CANCELLED, None)
        log.info("cancel requested", extra={"stream_id": stream_id, "request_id": info.request_id})
        return CancelOutcome(False, await self.info(stream_id) or info)

    async def finish(self, stream_id: str, reason: FinishReason, message: str | None) -> bool:
        """End a stream from the gateway (race-safe against its worker); True if ended here."""
        for _ in range(5):
            pipe = self.redis.pipeline(transaction=False)
            pipe.xrevrange(self.keys.stream(stream_id), count=1)
            M = MetaField
            fields = (M.STATUS, M.PROMPT_TOKENS, M.STREAM_TTL, M.REQUEST_ID, M.RESUMES,
                      M.DISCONNECTS, M.LOG_OWNER)  # fmt: skip
            pipe.hmget(self.keys.meta(stream_id), *fields)
            top, (st, pt, ttl, rid, *counts, owner) = await self._guard(pipe.execute())
            if st is None or _str(st) == StreamStatus.DONE:
                return False
            last = seq_of(top[0][0]) if top else -1
            first, events = plan_finish(last, int(pt or 0), reason, message)
            ttl_s = float(ttl or self.stream_ttl)
            call = Append(stream_id, first, events, {MetaField.FINISH_REASON: reason}, ttl_s)
            keys, args = append_call(self.keys, [call], maxlen=MAXLEN)
            raw = await self._guard(self._append(keys=keys, args=args))
            res = decode_append(raw[0])
            if res.status == 1:
                log_summary(
                    stream_id=stream_id,
                    request_id=_str(rid) or None,
                    finish_reason=reason,
                    prompt_tokens=int(pt or 0),
                    completion_tokens=max(0, last),
                    meta={RESUMES_FIELD: _str(counts[0]), DISCONNECTS_FIELD: _str(counts[1])},
                    ended_by=self.gateway_id,
                )
                await self.ledger.settle(_str(owner), stream_id, ttl_s)
                return True
            if res.status != 0:
                return False
        return False

    async def _end_abandoned(self, stream_id: str, message: str) -> None:
        try:
            await self.finish(stream_id, FinishReason.ERROR, message)
        except RedisUnavailable:
            pass

    # --- attachments ------------------------------------------------------------

    async def attach(self, stream_id: str) -> str:
        """Mark a client as attached to the stream (kept alive until :meth:`detach`)."""
        return await self.attachments.attach(stream_id)

    async def detach(self, stream_id: str, attach_id: str | None) -> None:
        """Drop an attachment (best effort: it lapses on its own anyway).

        A detach before the stream's end is a disconnect (counted for the
        metrics and the stream's summary line).
        """
        if await self.attachments.detach(stream_id, attach_id):
            self.disconnects += 1

    async def _count_field(self, stream_id: str, field: str) -> int:
        """HINCRBY ``field`` of a live stream's metadata; 0 when nothing was counted."""
        keys = [self.keys.meta(stream_id)]
        try:
            return int(await self._guard(self._count(keys=keys, args=[field])))
        except RedisUnavailable:
            return 0
