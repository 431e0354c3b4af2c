"""Live tailing of many stream logs: a published feed, and catch-up reads.

Long: one read loop serves both the single Redis and the cluster, with the liveness
checks it runs between reads; split, their shared subscriber state would be spread out.

A gateway may tail thousands of streams at once. Every append to a stream log
is also published on one channel as it lands (gateway/streams/feed.py), so a
:class:`Tailer` hands live events to its subscribers straight from that feed,
with no per-stream Redis read. A subscriber that is behind (it just joined,
its bounded buffer overflowed because its consumer is slow, or the feed was
down) is *lagging*: one read loop issues ``XREAD`` over the logs of the lagging
subscribers only, until each has read to the end of its log with nothing
published in the meantime that it missed. The Redis log is the buffer and the
truth; gateway memory stays bounded, and no stream waits for another. While
the feed is down the loop reads every subscribed log with ``XREAD BLOCK``, as
it would without a feed; a new subscriber interrupts a blocked read
(``CLIENT UNBLOCK``) so it starts being served at once.

On a Redis Cluster (``keys.cluster``) the feed is each stream's own sharded channel
(gateway/streams/shardfeed.py), subscribed while the stream has subscribers; a
subscriber stays lagging until its channel is confirmed. Catch-up reads are one
``XREAD`` per log (a command's keys share a slot) in one pipeline, never blocking: a
read that brought nothing waits :data:`CLUSTER_POLL` or a wake-up before the next.

Once a second, the tailer also looks at subscribed streams that have been
quiet: one that waits with no worker alive at all, or whose engine worker stopped
heartbeating and that no live worker continued within :data:`CONTINUE_DEADLINE` (workers
take such streams over themselves, worker/continuation.py), is ended with
``done``/``error``; one that expired fails
with :class:`StreamNotFound`; and each is read once from its log, in case
something published was missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from tokenrelay.core.redis.connection import Backoff, RedisHealth, is_outage, xread_one
from tokenrelay.core.wire.events import Event, decode_event, entry_id
from tokenrelay.core.wire.keys import CONTINUE_DEADLINE, Keys
from tokenrelay.core.wire.records import MetaField as M
from tokenrelay.core.wire.vocabulary import StreamStatus
from tokenrelay.gateway.errors import RedisUnavailable, StreamNotFound
from tokenrelay.gateway.streams.feed import LiveFeed
from tokenrelay.gateway.streams.shardfeed import ShardedFeed
from tokenrelay.gateway.streams.subscription import BUFFER_LIMIT, Subscription

log = logging.getLogger("tokenrelay.tailer")

BLOCK_MS = 1000
READ_COUNT = 64  # entries per stream per read
CHECK_INTERVAL = 1.0  # seconds between liveness checks of quiet streams
NO_WORKER_GRACE = 5.0  # a queued stream with no live worker this long is ended
CLUSTER_POLL = 0.05  # seconds between catch-up reads that found nothing (cluster)

__all__ = [
    "BUFFER_LIMIT",
    "RedisUnavailable",
    "StreamNotFound",
    "Subscription",
    "Tailer",
]

Finisher = Callable[[str, str], Awaitable[object]]


class Tailer:
    """Serves every :class:`Subscription` of one gateway: the live feed plus one read loop."""

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
        self.sharded = keys.cluster
        self.feed: LiveFeed | ShardedFeed
        if self.sharded:
            cluster = cast(RedisCluster, pool)  # connect_async(cluster=True) made it
            self.feed = ShardedFeed(url, cluster, keys, self._on_published, self._on_streams_gap)
        else:
            self.feed = LiveFeed(url, keys.events, self._on_published, self._on_feed_gap)
        self._subs: dict[str, set[Subscription]] = {}  # stream id -> its subscribers
        self._reading: dict[Subscription, int] = {}  # the current read's subscribers: missed
        self._wake_event = asyncio.Event()
        self._blocked_client: int | None = None
        self._client_id: int | None = None
        self._unblocking = False
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._last_check = 0.0
        self._missing_since: dict[str, float] = {}
        self._no_worker_since: float | None = None
        self.catch_up_reads = 0  # XREAD calls (for tests and the bench)

    def start(self) -> None:
        self.feed.start()
        self._task = asyncio.create_task(self._run(), name="tailer")

    async def close(self) -> None:
        self._closed = True  # also ends the loop if a cancel gets lost (wait_for, 3.11)
        await self.feed.close()
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
        self._subs.setdefault(stream_id, set()).add(sub)
        self.feed.watch(stream_id)
        self._wake()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        sub.closed = True
        subs = self._subs.get(sub.stream_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.stream_id]
                self.feed.unwatch(sub.stream_id)

    # --- the live feed ---------------------------------------------------------

    def _on_published(self, batch: list[tuple[str, int, list[Event]]]) -> None:
        appended = self.feed.appended_at  # the message's append time (delivery latency)
        for stream_id, first_seq, events in batch:
            subs = self._subs.get(stream_id)
            if subs:
                for sub in subs:
                    sub.offer(first_seq, events, appended)

    def _on_streams_gap(self, stream_ids: list[str]) -> None:
        """The sharded feed may have missed events of these streams: they catch up."""
        for sid in stream_ids:
            for sub in self._subs.get(sid, ()):
                sub.mark_lagging()
        self._wake()

    def _on_feed_gap(self) -> None:
        """Published events may have been missed: every subscriber catches up from its log."""
        for subs in self._subs.values():
            for sub in subs:
                sub.mark_lagging()
        self._wake()

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

    def _wanted(self, live: bool) -> dict[Any, Any]:
        """Where to read each log from; remembers which subscribers the read is for.

        With the feed ``live``, only lagging subscribers are read. A subscriber
        left out (its buffer is nearly full) must not be handed the reply: the
        read may start past its ``last_seq``, which would look like a gap.
        """
        wanted: dict[Any, Any] = {}
        self._reading = {}
        for subs in self._subs.values():
            ready = [
                s
                for s in subs
                if (s.lagging or not live) and s.room() >= READ_COUNT and s.error is None
            ]
            if ready:
                low = min(s.last_seq for s in ready)
                wanted[ready[0].key] = entry_id(low) if low >= 0 else "0-0"
                for s in ready:
                    self._reading[s] = s.missed
        return wanted

    async def _run(self) -> None:
        backoff = Backoff(0.1, 2.0)
        while not self._closed:
            self._wake_event.clear()
            live = self.feed.up
            wanted = self._wanted(live)
            try:
                if time.monotonic() - self._last_check >= CHECK_INTERVAL:
                    self._last_check = time.monotonic()
                    await self._checked_quiet()
                if not wanted:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake_event.wait(), CHECK_INTERVAL)
                    continue
                self.catch_up_reads += 1
                reply: Any
                if self.sharded:
                    reply = await self._read_each(wanted)
                elif live:  # catching up: read what is there, the feed brings the rest
                    reply = await self._conn.xread(wanted, count=READ_COUNT)
                else:
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
            self._dispatch(reply, caught_up_ok=live)
            if self.sharded and not any(entries for _, entries in reply):
                with contextlib.suppress(TimeoutError):  # nothing new: don't spin
                    await asyncio.wait_for(self._wake_event.wait(), CLUSTER_POLL)

    async def _read_each(self, wanted: dict[Any, Any]) -> list[tuple[Any, Any]]:
        """``XREAD`` of each log on its own, in one pipeline (a cluster's slots).

        A log whose shard does not answer fails only its own subscribers (``unavailable``):
        the streams of the other shards go on. When the pipeline fails as a whole (a node's
        connection dropped as it was sent, the slot map changing), each log is read alone.
        """
        pipe = self._pool.pipeline(transaction=False)
        for key, after in wanted.items():
            xread_one(pipe, key, after, READ_COUNT)
        try:
            replies = await pipe.execute(raise_on_error=False)
        except Exception:  # the whole pipeline failed (a node's connection, the slot map):
            replies = [await self._read_one(key, after) for key, after in wanted.items()]
        failed = {k: r for k, r in zip(wanted, replies, strict=True) if isinstance(r, Exception)}
        for key, exc in failed.items():
            if not is_outage(exc):
                log.warning("tailer read failed: %r", exc, extra={"key": str(key)})
            for sub in [s for s in self._reading if s.key == key]:
                sub.fail(RedisUnavailable("redis is unreachable (the stream's shard)"))
                del self._reading[sub]
        ok = (r for r in replies if not isinstance(r, Exception))
        return [pair for reply in ok for pair in reply or ()]

    async def _read_one(self, key: Any, after: Any) -> Any:
        """One log's ``XREAD`` alone: its reply, or its shard's exception."""
        pipe = self._pool.pipeline(transaction=False)
        xread_one(pipe, key, after, READ_COUNT)
        try:
            return (await pipe.execute(raise_on_error=False))[0]
        except Exception as exc:
            return exc

    def _dispatch(self, reply: object, *, caught_up_ok: bool) -> None:
        """Hand a read's entries to the subscribers it was for.

        ``caught_up_ok``: the read did not block and the feed was up when it
        was issued; a subscriber that took everything, reached the end of its
        log and missed no published batch meanwhile is then served by the feed.
        """
        got: dict[str, list[Event]] = {}
        for key, entries in reply or ():  # type: ignore[attr-defined]
            name = key.decode() if isinstance(key, bytes) else key
            got[name] = [decode_event(eid, fields) for eid, fields in entries]
        for sub, missed in self._reading.items():
            if sub.closed:
                continue
            events = got.get(sub.key, [])
            took = all([sub.push(ev) for ev in events])
            if (
                caught_up_ok
                and took
                and len(events) < READ_COUNT
                and sub.missed == missed
                and sub.error is None
                and self.feed.covers(sub.stream_id)
            ):
                sub.lagging = False
        self._reading = {}

    def _fail_all(self, exc: BaseException) -> None:
        for subs in list(self._subs.values()):
            for sub in list(subs):
                sub.fail(exc)

    # --- liveness of quiet streams -------------------------------------------

    async def _checked_quiet(self) -> None:
        """:meth:`_check_quiet`; a Redis that does not answer (a cluster's master down)
        fails no subscriber here: the reads fail those whose logs they cannot read."""
        try:
            await self._check_quiet()
        except Exception as exc:
            if not is_outage(exc):
                raise
            self._health.failed(exc)

    async def _check_quiet(self) -> None:
        now = time.monotonic()
        quiet_subs = [
            s
            for subs in self._subs.values()
            for s in subs
            if now - s.quiet_since >= CHECK_INTERVAL and s.error is None
        ]
        if not quiet_subs:
            return
        for sub in quiet_subs:
            sub.mark_lagging()  # read its log once: a published batch may have been missed
        quiet = sorted({s.stream_id for s in quiet_subs})
        pipe = self._pool.pipeline(transaction=False)
        for sid in quiet:
            pipe.hmget(self.keys.meta(sid), M.STATUS, M.WORKER, M.REQUEST_ID)
        pipe.smembers(self.keys.workers)
        # on a cluster, a shard that does not answer leaves out only what lives there
        replies = await pipe.execute(raise_on_error=not self.sharded)
        members = replies[-1]
        if isinstance(members, Exception):
            return  # the worker set's shard is down: judge nothing now
        metas = [(sid, m) for sid, m in zip(quiet, replies[:-1], strict=True) if type(m) is list]
        named = {w.decode() for _, (_, w, _) in metas if w}
        workers = sorted({m.decode() for m in members} | named)
        pipe = self._pool.pipeline(transaction=False)
        for w in workers:
            pipe.exists(self.keys.worker(w))
        found = await pipe.execute(raise_on_error=not self.sharded)
        alive = {
            w: bool(x) for w, x in zip(workers, found, strict=True) if not isinstance(x, Exception)
        }
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
        for sid, (st, w, rid) in metas:
            await self._judge(sid, st, w, rid.decode() if rid else None, now)

    async def _judge(
        self, sid: str, st: bytes | None, w: bytes | None, rid: str | None, now: float
    ) -> None:
        if st is None:
            for sub in list(self._subs.get(sid, ())):
                sub.fail(StreamNotFound("stream expired"))
            return
        if st == StreamStatus.RUNNING.encode() and w:
            # a live worker continues it (worker/continuation.py); this is only the backstop
            # for a stream nobody continued: no worker serves its model, or serve gave up
            since = self._missing_since.get(w.decode())
            if since is not None and now - since >= CONTINUE_DEADLINE:
                extra = {"stream_id": sid, "request_id": rid, "worker": w.decode()}
                log.warning("no worker continued a dead worker's stream; ending it", extra=extra)
                await self._finish(
                    sid,
                    f"engine worker {w.decode()} stopped responding and no worker continued "
                    f"the stream within {CONTINUE_DEADLINE:g} s",
                )
        elif (
            st == StreamStatus.QUEUED.encode()
            and now - (self._no_worker_since or now) >= NO_WORKER_GRACE
        ):
            await self._finish(sid, "no engine worker is available")
