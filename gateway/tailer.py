"""Live tailing of many stream logs over one blocking Redis connection.

A gateway may tail thousands of streams at once. Instead of one blocked
``XREAD`` (and one Redis connection) per stream, a :class:`Tailer` runs one
loop that issues ``XREAD BLOCK`` over every subscribed stream with room in its
buffer, and hands the entries to the subscribers. A subscriber whose consumer
is slow fills its bounded buffer and is simply left out of the next reads
until it drains: the Redis log is the buffer, gateway memory stays bounded,
and no other stream waits for it. A new subscriber interrupts the blocked read
(``CLIENT UNBLOCK``) so it starts being served at once.

Once a second, the tailer also looks at subscribed streams that have been
quiet: one whose engine worker stopped heartbeating (or that waits with no
worker alive at all) is ended with ``done``/``error``; one that expired fails
with :class:`StreamNotFound`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from gateway.redisconn import Backoff, RedisHealth, is_outage
from gateway.schema import WORKER_DEAD_GRACE, Event, Keys, decode_event, entry_id

log = logging.getLogger("tokenrelay.tailer")

BLOCK_MS = 1000
READ_COUNT = 64  # entries per stream per read
BUFFER_LIMIT = 256  # events buffered per subscriber, at most
CHECK_INTERVAL = 1.0  # seconds between liveness checks of quiet streams
NO_WORKER_GRACE = 5.0  # a queued stream with no live worker this long is ended


class StreamNotFound(Exception):
    """The stream does not exist (never did, or expired)."""


class RedisUnavailable(Exception):
    """Redis cannot be reached right now."""


Finisher = Callable[[str, str], Awaitable[object]]


class Subscription:
    """One consumer's live view of one stream (events with seq > ``last_seq``)."""

    def __init__(self, stream_id: str, key: str, last_seq: int) -> None:
        self.stream_id = stream_id
        self.key = key
        self.last_seq = last_seq
        self.buffer: deque[Event] = deque()
        self.error: BaseException | None = None
        self.quiet_since = time.monotonic()
        self.closed = False
        self._ready = asyncio.Event()
        self._wake: Callable[[], None] = lambda: None

    def room(self) -> int:
        return BUFFER_LIMIT - len(self.buffer)

    def push(self, event: Event) -> None:
        """Buffer ``event`` if it is the next one and there is room (else it is read again)."""
        if event.seq <= self.last_seq or self.closed or len(self.buffer) >= BUFFER_LIMIT:
            return
        if event.seq > self.last_seq + 1:  # only trimming (MAXLEN) can do this
            self.fail(StreamNotFound(f"events after seq {self.last_seq} are no longer kept"))
            return
        self.buffer.append(event)
        self.last_seq = event.seq
        self.quiet_since = time.monotonic()
        self._ready.set()

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._ready.set()

    async def get(self) -> list[Event]:
        """Wait for events; returns all buffered ones (raises the failure, if any)."""
        while not self.buffer:
            if self.error is not None:
                raise self.error
            self._ready.clear()
            await self._ready.wait()
        out = list(self.buffer)
        self.buffer.clear()
        self._wake()  # may have been left out of reads while full
        return out


class Tailer:
    """Serves every :class:`Subscription` of one gateway from one read loop."""

    def __init__(
        self,
        url: str,
        keys: Keys,
        pool: aioredis.Redis,
        health: RedisHealth,
        finisher: Finisher,
    ) -> None:
        self.keys = keys
        self._pool = pool  # for CLIENT UNBLOCK and the liveness checks
        self._conn = aioredis.Redis.from_url(
            url,
            protocol=2,
            socket_connect_timeout=1.0,
            socket_timeout=BLOCK_MS / 1000 + 5,
            single_connection_client=True,
            retry=Retry(NoBackoff(), 0),  # a reconnect changes the client id: no silent retry
        )
        self._health = health
        self._finish = finisher
        self._subs: dict[str, set[Subscription]] = {}
        self._reading: set[Subscription] = set()  # the subscribers the current read is for
        self._wake_event = asyncio.Event()
        self._blocked_client: int | None = None
        self._client_id: int | None = None
        self._unblocking = False
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._last_check = 0.0
        self._missing_since: dict[str, float] = {}
        self._no_worker_since: float | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tailer")

    async def close(self) -> None:
        self._closed = True  # also ends the loop if a cancel gets lost (wait_for, 3.11)
        if self._task is not None:
            self._task.cancel()
            self._wake_event.set()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for subs in self._subs.values():
            for sub in subs:
                sub.fail(RedisUnavailable("gateway shutting down"))
        await self._conn.aclose()

    @property
    def count(self) -> int:
        return sum(len(s) for s in self._subs.values())

    def subscribe(self, stream_id: str, last_seq: int) -> Subscription:
        """Start delivering events of ``stream_id`` with seq > ``last_seq``."""
        sub = Subscription(stream_id, self.keys.stream(stream_id), last_seq)
        sub._wake = self._wake
        self._subs.setdefault(sub.key, set()).add(sub)
        self._wake()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        sub.closed = True
        subs = self._subs.get(sub.key)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.key]

    # --- the read loop -----------------------------------------------------

    def _wake(self) -> None:
        self._wake_event.set()
        if self._blocked_client is not None and not self._unblocking:
            self._unblocking = True
            asyncio.get_running_loop().create_task(self._unblock(self._blocked_client))

    async def _unblock(self, client_id: int) -> None:
        try:
            for _ in range(5):  # the read may not have reached Redis yet
                if self._blocked_client != client_id:
                    return
                if await self._pool.client_unblock(client_id):
                    return
                await asyncio.sleep(0.002)
        except Exception as exc:
            if not is_outage(exc):
                log.debug("client unblock failed", exc_info=True)
        finally:
            self._unblocking = False

    def _wanted(self) -> dict[Any, Any]:
        """Where to read each stream from; remembers which subscribers the read is for.

        A subscriber left out (its buffer is nearly full) must not be handed the
        reply: the read may start past its ``last_seq``, which would look like a gap.
        """
        wanted: dict[Any, Any] = {}
        self._reading = set()
        for key, subs in self._subs.items():
            ready = [s for s in subs if s.room() >= READ_COUNT and s.error is None]
            if ready:
                low = min(s.last_seq for s in ready)
                wanted[key] = entry_id(low) if low >= 0 else "0-0"
                self._reading.update(ready)
        return wanted

    async def _run(self) -> None:
        backoff = Backoff(0.1, 2.0)
        while not self._closed:
            self._wake_event.clear()
            wanted = self._wanted()
            try:
                if time.monotonic() - self._last_check >= CHECK_INTERVAL:
                    self._last_check = time.monotonic()
                    await self._check_quiet()
                if not wanted:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake_event.wait(), CHECK_INTERVAL)
                    continue
                if self._client_id is None:
                    self._client_id = int(await self._conn.client_id())
                self._blocked_client = self._client_id
                try:
                    reply = await self._conn.xread(wanted, count=READ_COUNT, block=BLOCK_MS)
                finally:
                    self._blocked_client = None
                self._health.ok()
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._client_id = None
                if not is_outage(exc):
                    log.exception("tailer read failed")
                else:
                    self._health.failed(exc)
                self._fail_all(RedisUnavailable("redis is unreachable"))
                await asyncio.sleep(backoff.next())
                continue
            self._dispatch(reply)

    def _dispatch(self, reply: object) -> None:
        if not reply:
            return
        for key, entries in reply:  # type: ignore[attr-defined]
            subs = self._subs.get(key.decode() if isinstance(key, bytes) else key)
            if not subs:
                continue
            events = [decode_event(eid, fields) for eid, fields in entries]
            for sub in list(subs):
                if sub in self._reading:
                    for ev in events:
                        sub.push(ev)

    def _fail_all(self, exc: BaseException) -> None:
        for subs in list(self._subs.values()):
            for sub in list(subs):
                sub.fail(exc)

    # --- liveness of quiet streams -------------------------------------------

    async def _check_quiet(self) -> None:
        now = time.monotonic()
        quiet = sorted(
            {
                s.stream_id
                for subs in self._subs.values()
                for s in subs
                if now - s.quiet_since >= CHECK_INTERVAL and s.error is None
            }
        )
        if not quiet:
            return
        pipe = self._pool.pipeline(transaction=False)
        for sid in quiet:
            pipe.hmget(self.keys.meta(sid), "st", "w", "rid")
        pipe.smembers(self.keys.workers)
        replies = await pipe.execute()
        metas, members = replies[:-1], replies[-1]
        named = {w.decode() for _, w, _ in metas if w}
        workers = sorted({m.decode() for m in members} | named)
        pipe = self._pool.pipeline(transaction=False)
        for w in workers:
            pipe.exists(self.keys.worker(w))
        alive = dict(zip(workers, [bool(x) for x in await pipe.execute()], strict=True))
        for w, up in alive.items():
            if up:
                self._missing_since.pop(w, None)
            else:
                self._missing_since.setdefault(w, now)
        any_alive = any(alive.values())
        if any_alive:
            self._no_worker_since = None
        elif self._no_worker_since is None:
            self._no_worker_since = now
        for sid, (st, w, rid) in zip(quiet, metas, strict=True):
            await self._judge(sid, st, w, rid.decode() if rid else None, now)

    async def _judge(
        self, sid: str, st: bytes | None, w: bytes | None, rid: str | None, now: float
    ) -> None:
        if st is None:
            for sub in list(self._subs.get(self.keys.stream(sid), ())):
                sub.fail(StreamNotFound("stream expired"))
            return
        if st == b"running" and w:
            since = self._missing_since.get(w.decode())
            if since is not None and now - since >= WORKER_DEAD_GRACE:
                extra = {"stream_id": sid, "request_id": rid, "worker": w.decode()}
                log.warning("engine worker stopped responding; ending its stream", extra=extra)
                await self._finish(sid, f"engine worker {w.decode()} stopped responding")
        elif st == b"queued" and now - (self._no_worker_since or now) >= NO_WORKER_GRACE:
            await self._finish(sid, "no engine worker is available")
