"""A worker's reads of its request queues on a Redis Cluster: shard sweeps, wake-ups.

On one Redis a worker reads all its queues with one ``XREADGROUP`` and, when idle,
blocks in it (worker/store.py). On a cluster a model's queue is
:data:`~core.wire.keys.QUEUE_SHARDS` streams on several masters: a command's keys share
a slot, so :class:`ShardReader` sweeps them, one ``XREADGROUP`` each, in one pipeline.
No command blocks on them all, so a gateway that queues a request also publishes on the
model's wake channel (``SPUBLISH P wake:{w}:<model>``, one small message per request),
and an idle worker waits on the channels of its models (:class:`Wake`) between sweeps:
no polling while idle, and no delay for a request.

The subscription is confirmed before the first sweep, so a request queued after any
sweep wakes the next wait. While the channel's master does not answer, :meth:`Wake.wait`
polls instead (:data:`POLL_S`) and subscribes again every :data:`RETRY_S`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tokenrelay.core.redis.connection import credentials, is_outage, xreadgroup_one
from tokenrelay.core.wire.keys import GROUP, slot_of
from tokenrelay.core.wire.records import text
from tokenrelay.worker.requests import entries_of

log = logging.getLogger("tokenrelay.worker")

POLL_S = 0.01  # without a subscription: a sweep this often
RETRY_S = 1.0  # ... and a new subscription this often
CONFIRM_S = 1.0  # how long a new subscription may take to be confirmed


class Wake:
    """The wake channels of one worker's models, on the master of their slot."""

    def __init__(self, cluster: Any, url: str, channels: list[str]) -> None:
        self._cluster = cluster  # redis-py's RedisCluster: its slot map finds the master
        self._credentials = credentials(url)
        self.channels = sorted(set(channels))
        self._conn: redis.Redis | None = None
        self._pubsub: Any = None
        self._retry_at = 0.0

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a wake-up; True when one came (or this
        cannot tell: no subscription, so the caller should sweep anyway)."""
        if self._pubsub is None and not self._subscribe():
            time.sleep(min(timeout, POLL_S))
            return True
        try:
            msg = self._pubsub.get_message(timeout=timeout)
            while msg is not None and self._pubsub.get_message(timeout=0) is not None:
                pass  # several requests, one sweep
        except Exception as exc:
            if not is_outage(exc):
                log.warning("wake channel failed: %r", exc)
            self.close()
            return True
        if msg is not None and msg["type"] != "smessage":  # dropped (its slot moved)
            self.close()
        return msg is not None

    def _subscribe(self) -> bool:
        """Subscribe every channel on its master and wait for the confirmations."""
        if time.monotonic() < self._retry_at:
            return False
        self._retry_at = time.monotonic() + RETRY_S
        try:
            node = self._cluster.nodes_manager.get_node_from_slot(slot_of(self.channels[0]))
            self._conn = redis.Redis(
                host=node.host,
                port=int(node.port),
                protocol=2,
                socket_connect_timeout=1.0,
                socket_timeout=None,
                retry=Retry(NoBackoff(), 0),
                **self._credentials,
            )
            self._pubsub = self._conn.pubsub()
            for channel in self.channels:  # one slot: they share a master
                self._pubsub.ssubscribe(channel)
            waiting, deadline = set(self.channels), time.monotonic() + CONFIRM_S
            while waiting:
                if time.monotonic() > deadline:
                    raise TimeoutError("the wake channels' subscription was not confirmed")
                msg = self._pubsub.get_message(timeout=0.05)
                if msg is not None and msg["type"] == "ssubscribe":
                    waiting.discard(text(msg["channel"]))
        except Exception as exc:
            if not is_outage(exc) and not isinstance(exc, TimeoutError):
                log.warning("wake channel subscription failed: %r", exc)
            self.close()
            return False
        return True

    def close(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                self._pubsub.close()
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._pubsub = self._conn = None


class ShardReader:
    """One worker's reads of its request queues' shards, on a cluster."""

    def __init__(self, cluster: Any, url: str, worker_id: str) -> None:
        self._cluster = cluster
        self._url = url
        self.worker_id = worker_id
        self._wake: Wake | None = None

    def queue(self, pipe: Any, queues: list[str], count: int, after: str = ">") -> None:
        """Queue one ``XREADGROUP`` per queue shard on ``pipe``."""
        for queue in queues:
            xreadgroup_one(pipe, GROUP, self.worker_id, queue, after, count, None)

    def read(
        self, queues: list[str], wake: list[str], count: int, block_ms: int | None
    ) -> list[tuple[str, Any, Any]]:
        """``(queue, entry id, fields)`` of new requests; with ``block_ms``, waits that long
        for a wake-up on the ``wake`` channels when none is there, then sweeps again."""
        if block_ms and self._wake is None:
            self._wake = Wake(self._cluster, self._url, wake)
            self._wake.wait(0)  # subscribed before the sweep: no wake-up is missed
        found = self._sweep(queues, count)
        if found or not block_ms or self._wake is None:
            return found
        return self._sweep(queues, count) if self._wake.wait(block_ms / 1000) else []

    def _sweep(self, queues: list[str], count: int) -> list[tuple[str, Any, Any]]:
        pipe = self._cluster.pipeline(transaction=False)
        self.queue(pipe, queues, count)
        try:
            replies = pipe.execute()
        except Exception as exc:
            if not is_outage(exc):
                raise
            return self.each(queues, count)  # a master is down: read the others' shards
        return [e for reply in replies for e in entries_of(reply)]

    def each(self, queues: list[str], count: int, after: str = ">") -> list[tuple[str, Any, Any]]:
        """The entries of one read per queue shard, leaving out those whose master does not
        answer (all of them failing is the outage it is)."""
        out: list[Any] = []
        failed: Exception | None = None
        for queue in queues:
            pipe = self._cluster.pipeline(transaction=False)
            self.queue(pipe, [queue], count, after)
            try:
                out += pipe.execute()
            except Exception as exc:
                if not is_outage(exc):
                    raise
                failed = exc
        if failed is not None and len(out) == 0:
            raise failed
        return [e for reply in out for e in entries_of(reply)]

    def reset(self) -> None:
        """The worker's models changed: subscribe their wake channels at the next wait."""
        if self._wake is not None:
            self._wake.close()
            self._wake = None
