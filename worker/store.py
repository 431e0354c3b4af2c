"""The stream log as engine workers see it (blocking redis-py, no asyncio).

A worker takes requests from the queues of its models (``P requests:<model>``;
``P requests`` for a worker that names none) in the consumer group, appends each
engine step's events for all its streams in one pipelined round trip
(:meth:`WorkerStore.flush`), learns about cancels, checks whether clients are still
attached, publishes a heartbeat, and claims the requests of workers that died.
Keys: core/wire/keys.py; fields: core/wire/records.py.

On a Redis Cluster (``cluster=True``) the same calls are split by slot: a queue is
:data:`~core.wire.keys.QUEUE_SHARDS` streams (worker/shards.py reads them, and wakes an
idle worker when a gateway queues a request), and an append call holds the streams of
one master (:data:`~core.wire.scripts.APPEND_CLUSTER_LUA`), all calls in one pipeline
that redis-py sends to the masters concurrently.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import redis

from tokenrelay.core.redis.connection import (
    atomic_pipeline,
    connect_sync,
    is_full,
    is_outage,
    queue_script,
)
from tokenrelay.core.wire.keys import (
    DEFAULT_PREFIX,
    GROUP,
    HEARTBEAT_TTL,
    Keys,
)
from tokenrelay.core.wire.records import MetaField as M
from tokenrelay.core.wire.records import RequestField, text
from tokenrelay.core.wire.scripts import (
    ATTACHED_LUA,
    RELEASE_LUA,
    AppendResult,
)
from tokenrelay.core.wire.stats import STATS_FIELD, WorkerStats
from tokenrelay.worker.appends import Appender, Batch
from tokenrelay.worker.outage import Masters
from tokenrelay.worker.requests import Request, entries_of, parse_request
from tokenrelay.worker.shards import ShardReader

log = logging.getLogger("tokenrelay.worker")

# a request delivered this recently is not claimed even if its worker has no heartbeat yet
# (a worker reads its first request a moment before its first beat lands)
CLAIM_MIN_IDLE = 1.0


class WorkerStore:
    """Blocking Redis access for one engine worker."""

    def __init__(
        self,
        url: str,
        worker_id: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        models: list[str] | None = None,
        cluster: bool = False,
    ) -> None:
        self.keys = Keys(prefix, cluster=cluster)
        self.cluster = cluster
        self.worker_id = worker_id
        self.models: list[str] = []  # the names announced: the queues read
        self.queues = [self.keys.requests]
        self.redis = connect_sync(url, cluster=cluster)
        self.shards = ShardReader(self.redis, url, worker_id) if cluster else None
        self.masters = Masters(self.redis) if cluster else None
        self.appender = Appender(self.redis, self.keys, self.masters)
        self.serve(models or [])
        self._release = self.redis.register_script(RELEASE_LUA)
        self._control_cursor: str | None = None
        self._control_ahead: list[str] | None = None  # read by read_new(), not yet returned

    def close(self) -> None:
        if self.shards is not None:
            self.shards.reset()  # its wake-channel connection
        self.redis.close()

    def serve(self, models: list[str]) -> None:
        """Read the request queues of ``models`` from now on (none: ``P requests``).

        Call :meth:`ensure_group` after a change. Requests taken from a queue no longer
        read are still acknowledged in theirs (:class:`Request` knows its queue).
        """
        self.models = list(models)
        named: list[str | None] = [*models] or [None]
        self.queues = [q for m in named for q in self.keys.queue_shards(m)]
        self.wake_channels = [w for m in named for w in self.keys.wakes(m)]
        if self.shards is not None:
            self.shards.reset()

    def follow(self, served: Callable[[], list[str] | None] | None) -> None:
        """Serve what ``served()`` says, when it says (a relay learns its upstream's list)."""
        models = served() if served is not None else None
        if models is not None and models != self.models:
            self.serve(models)
            self.ensure_group()
            log.info("serving models", extra={"worker": self.worker_id, "models": models})

    def _queue(self, queue: str | None) -> str:
        return queue or self.keys.requests

    def _read_count(self, count: int) -> int:
        """Entries to ask of each queue: ``count`` in all, whatever the number of queues."""
        return max(1, count // len(self.queues))

    # --- setup ---------------------------------------------------------------------

    def ensure_group(self) -> None:
        """Create the request queues and their consumer group where missing."""
        for queue in self.queues:
            try:
                self.redis.xgroup_create(queue, GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    # --- requests --------------------------------------------------------------------

    def read_requests(self, count: int, block_ms: int | None) -> list[Request]:
        """Up to ``count`` new requests for this worker (waits ``block_ms`` when idle)."""
        count = self._read_count(count)
        if self.shards is not None:
            return self._with_meta(
                self.shards.read(self.queues, self.wake_channels, count, block_ms)
            )
        streams: dict[Any, Any] = dict.fromkeys(self.queues, ">")
        reply = self.redis.xreadgroup(GROUP, self.worker_id, streams, count, block_ms)
        return self._with_meta(entries_of(reply))

    def _queue_reads(self, pipe: Any, count: int, after: str = ">") -> None:
        """Queue the read of every request queue: one ``XREADGROUP`` (one per shard on a
        cluster, where a command's keys share a slot)."""
        if self.shards is not None:
            self.shards.queue(pipe, self.queues, count, after)
        else:
            pipe.xreadgroup(GROUP, self.worker_id, dict.fromkeys(self.queues, after), count)

    def read_new(self, count: int) -> list[Request]:
        """:meth:`read_requests` without blocking, and the read of :meth:`read_control`
        in the same round trip (for a busy worker: its step is waiting).

        The cancel notices wait here for the next :meth:`read_control` call. If their
        read failed, that call reads them itself, as it would have anyway.
        """
        pipe = self.redis.pipeline(transaction=False)
        self._queue_reads(pipe, self._read_count(count))
        self._control_read(pipe)
        try:
            *replies, control = pipe.execute(raise_on_error=False)
        except Exception as exc:
            if self.shards is None or not is_outage(exc):
                raise
            return self._read_new_apart(count)  # a master is down: read the others
        for reply in replies:
            if isinstance(reply, Exception):
                if self.shards is not None and is_outage(reply):
                    return self._read_new_apart(count)
                raise reply
        requests = self._with_meta([e for reply in replies for e in entries_of(reply)])
        if not isinstance(control, Exception):  # the cursor moves only once nothing can fail
            self._control_ahead = (self._control_ahead or []) + self._control_taken(control)
        return requests

    def _read_new_apart(self, count: int) -> list[Request]:
        """:meth:`read_new` on a cluster with a master down: each shard and the control
        stream on their own, those of the down master left out."""
        assert self.shards is not None
        self._control_ahead = (self._control_ahead or []) + self.read_control()
        return self._with_meta(self.shards.read(self.queues, [], self._read_count(count), None))

    def read_own_pending(self) -> list[Request]:
        """Requests this worker id took before (a restart with a fixed ``--worker-id``)."""
        if self.shards is not None:  # each shard on its own: a master may be down
            found = self.shards.each(self.queues, 1000, after="0")
            return self._with_meta([e for e in found if e[2]])
        pipe = self.redis.pipeline(transaction=False)
        self._queue_reads(pipe, 1000, after="0")
        return self._with_meta([e for r in pipe.execute() for e in entries_of(r) if e[2]])

    def _with_meta(self, entries: list[tuple[str, Any, Any]]) -> list[Request]:
        """Requests of ``(queue, entry id, fields)`` entries, with their streams' metadata."""
        if not entries:
            return []
        keys = [
            self.keys.meta(text(f.get(RequestField.STREAM_ID.encode(), b""))) for *_, f in entries
        ]
        if self.masters is not None:  # those of a down master wait, pending (read_own_pending)
            got = self.masters.each(keys, lambda pipe, key: pipe.hgetall(key))
            entries = [e for e, k in zip(entries, keys, strict=True) if k in got]
            metas = [got[k] for k in keys if k in got]
        else:
            pipe = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(key)
            metas = pipe.execute()
        plain = self.keys.requests  # Request.queue None: this one
        return [
            parse_request(None if queue == plain else queue, eid, fields, meta)
            for (queue, eid, fields), meta in zip(entries, metas, strict=True)
        ]

    def ack(self, entry_ids: list[str], queue: str | None = None) -> None:
        """Acknowledge and delete finished requests of ``queue`` (None: ``P requests``)."""
        if entry_ids:
            key = self._queue(queue)
            pipe = self.redis.pipeline(transaction=False)
            pipe.xack(key, GROUP, *entry_ids)
            pipe.xdel(key, *entry_ids)
            pipe.execute()

    # --- appending -----------------------------------------------------------------------

    def flush(self, batches: list[Batch]) -> list[AppendResult | None]:
        """Append every batch (:meth:`Appender.flush`); one result per batch."""
        return self.appender.flush(batches)

    # --- control -----------------------------------------------------------------------

    def read_control(self) -> list[str]:
        """Stream ids with a cancel notice since the last call."""
        if self._control_ahead is not None:  # read_new() read them already
            out, self._control_ahead = self._control_ahead, None
            return out
        if self.masters is None:
            return self._control_taken(self._control_read(self.redis))
        replies = self.masters.run(self.masters.of_key(self.keys.control), self._control_read)
        return [] if replies is None else self._control_taken(replies[0])  # down: later

    def _control_read(self, client: Any) -> Any:
        """Send (on a client) or queue (on a pipeline) the read of the control stream.

        The first read only finds where the stream ends: notices from then on count.
        """
        if self._control_cursor is None:
            return client.xrevrange(self.keys.control, count=1)
        return client.xread({self.keys.control: self._control_cursor}, count=500)

    def _control_taken(self, reply: Any) -> list[str]:
        """The stream ids in a reply to :meth:`_control_read`; moves the cursor past them."""
        if self._control_cursor is None:
            self._control_cursor = text(reply[0][0]) if reply else "0-0"
            return []
        out = []
        for _, entries in reply or []:
            for eid, fields in entries:
                self._control_cursor = text(eid)
                sid = fields.get(b"cancel")
                if sid:
                    out.append(text(sid))
        return out

    def poll(self, stream_ids: list[str]) -> dict[str, tuple[int, bool]]:
        """``{stream_id: (live attachments, cancel requested)}`` in one round trip."""
        if not stream_ids:
            return {}
        attach = [self.keys.attach(s) for s in stream_ids]
        if self.masters is not None:  # per master: the streams of a down master left out
            n = self.masters.each(attach, lambda p, k: queue_script(p, ATTACHED_LUA, [k], []))
            meta = [self.keys.meta(s) for s in stream_ids]
            cancel = self.masters.each(meta, lambda p, k: p.hget(k, M.CANCEL))
            return {
                sid: (int(n[a][0]), cancel[m] == b"1")
                for sid, a, m in zip(stream_ids, attach, meta, strict=True)
                if a in n and m in cancel
            }
        pipe = self.redis.pipeline(transaction=False)
        queue_script(pipe, ATTACHED_LUA, attach, [])
        for sid in stream_ids:
            pipe.hget(self.keys.meta(sid), M.CANCEL)
        counts, *flags = pipe.execute()
        return {
            sid: (int(n), flag == b"1")
            for sid, n, flag in zip(stream_ids, counts, flags, strict=True)
        }

    def stream_counts(self, stream_ids: list[str]) -> list[dict[str, str]]:
        """Each stream's resume and disconnect counts (``rs``/``dc``, kept by gateways)."""
        pipe = self.redis.pipeline(transaction=False)
        for sid in stream_ids:
            pipe.hmget(self.keys.meta(sid), M.RESUMES, M.DISCONNECTS)
        return [
            {M.RESUMES: text(rs or b"0"), M.DISCONNECTS: text(dc or b"0")}
            for rs, dc in pipe.execute()
        ]

    def release(self, stream_id: str) -> bool:
        """Hand an unstarted stream back to the queue (see :data:`RELEASE_LUA`).

        Its request entry stays pending under this worker's name, unacknowledged:
        once this worker's heartbeat is gone another worker claims it.
        """
        keys = [self.keys.stream(stream_id), self.keys.meta(stream_id)]
        return bool(self._release(keys=keys, args=[self.worker_id]))

    # --- liveness --------------------------------------------------------------------

    def heartbeat(self, stats: WorkerStats) -> None:
        """Refresh this worker's heartbeat key with its current stats.

        A full Redis (maxmemory) refuses the stats; the key's expiry is still
        renewed (``PEXPIRE`` needs no memory), so gateways do not take this worker
        for dead, and the error is raised for the caller to report.
        """
        key = self.keys.worker(self.worker_id)
        pipe = atomic_pipeline(self.redis)
        pipe.hset(
            key,
            mapping={
                STATS_FIELD: stats.to_json(),
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "ts": f"{time.time():.3f}",
            },
        )
        pipe.pexpire(key, int(HEARTBEAT_TTL * 1000))
        pipe.sadd(self.keys.workers, self.worker_id)
        try:
            pipe.execute()
        except redis.ResponseError as exc:
            if is_full(exc):
                self.redis.pexpire(key, int(HEARTBEAT_TTL * 1000))
            raise

    def unregister(self) -> None:
        """Remove this worker's heartbeat (clean exit)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.worker(self.worker_id))
        pipe.srem(self.keys.workers, self.worker_id)
        pipe.execute()

    def claim_dead(self) -> list[Request]:
        """Take over the pending requests of workers whose heartbeat is gone, in the
        queues this worker reads (a dead worker's other models wait for their workers)."""
        out: list[Request] = []
        for queue in self.queues:
            try:
                out += self._claim_dead(queue)
            except Exception as exc:  # a master down (a cluster): its queues' claims wait
                if self.masters is None or not is_outage(exc):
                    raise
        return out

    def _claim_dead(self, queue: str) -> list[Request]:
        pending: Any = self.redis.xpending_range(queue, GROUP, "-", "+", 200)
        owners = sorted({text(p["consumer"]) for p in pending} - {self.worker_id})
        if not owners:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for w in owners:
            pipe.exists(self.keys.worker(w))
        dead = {w for w, up in zip(owners, pipe.execute(), strict=True) if not up}
        min_idle = int(CLAIM_MIN_IDLE * 1000)
        ids = [
            text(p["message_id"])
            for p in pending
            if text(p["consumer"]) in dead and p["time_since_delivered"] >= min_idle
        ]
        if not ids:
            return []
        claimed: Any = self.redis.xclaim(queue, GROUP, self.worker_id, min_idle, list[Any](ids))
        live = [(queue, eid, f) for eid, f in claimed if f]
        gone = [text(eid) for eid, f in claimed if not f]  # deleted entries: just ack
        if gone:
            self.redis.xack(queue, GROUP, *gone)
        for w in dead:
            log.warning("claimed the requests of a dead worker", extra={"dead_worker": w})
            self.redis.srem(self.keys.workers, w)
        return self._with_meta(live)
