"""A worker's reads of its request queues on a Redis Cluster: shard sweeps, wake-ups.

On one Redis a worker reads all its queues with one ``XREADGROUP`` and, when idle,
blocks in it (worker/store.py). On a cluster a model's queue is
:data:`~core.wire.keys.QUEUE_SHARDS` streams on several masters: a command's keys share
a slot, so :class:`ShardReader` sweeps them, one ``XREADGROUP`` each, in one pipeline.
No command blocks on them all, so a gateway that queues a request on a shard also
publishes on that shard's wake channel (``SPUBLISH P wake:{qN}:<model>``, in the
shard's slot: one small message per request), and an idle worker waits on the wake
channels of all its shards (:class:`Wake`) between sweeps: no polling while idle, and
no delay for a request.

:class:`Wake` keeps one subscription per master, to the channels of the slots it
serves, and waits on all of them at once (``select`` on their sockets). A master that
does not answer takes only its own shards' wake-ups with it (their requests cannot be
read meanwhile anyway): the worker goes on waiting on the others, and tries to subscribe
the missing channels again every :data:`RETRY_S`, a wait lasting no longer than that
while any is missing. Subscriptions are confirmed before the caller sweeps, so a request
queued after any sweep wakes the next wait; a new or lost subscription makes the wait
return at once, for a sweep. With no subscription at all, :meth:`Wake.wait` polls
(:data:`POLL_S`).
"""

from __future__ import annotations

import contextlib
import logging
import select
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

POLL_S = 0.01  # without any subscription: a sweep this often
RETRY_S = 1.0  # ... and new subscriptions for the missing channels this often
CONFIRM_S = 1.0  # how long a new subscription may take to be confirmed


class _Subscription:
    """One master's connection, subscribed to the wake channels of its slots."""

    def __init__(self, node: Any, channels: list[str], auth: dict[str, Any]) -> None:
        self.channels = channels
        self.conn = redis.Redis(
            host=node.host,
            port=int(node.port),
            protocol=2,
            socket_connect_timeout=1.0,
            socket_timeout=None,
            retry=Retry(NoBackoff(), 0),
            **auth,
        )
        self.pubsub: Any = self.conn.pubsub()

    def confirm(self) -> None:
        """Subscribe every channel and wait for the confirmations."""
        for channel in self.channels:
            self.pubsub.ssubscribe(channel)
        waiting, deadline = set(self.channels), time.monotonic() + CONFIRM_S
        while waiting:
            if time.monotonic() > deadline:
                raise TimeoutError("the wake channels' subscription was not confirmed")
            msg = self.pubsub.get_message(timeout=0.05)
            if msg is not None and msg["type"] == "ssubscribe":
                waiting.discard(text(msg["channel"]))

    def fileno(self) -> int:
        """The connection's socket, for ``select`` (redis-py keeps it as ``_sock``)."""
        sock = getattr(self.pubsub.connection, "_sock", None)
        if sock is None:
            raise ConnectionError("the wake channels' connection is closed")
        return int(sock.fileno())

    def drain(self) -> int:
        """Wake-ups waiting (every message read); ``-1`` when the master dropped the
        subscription (a slot moved)."""
        woken = 0
        while (msg := self.pubsub.get_message(timeout=0)) is not None:
            if msg["type"] == "smessage":
                woken += 1
            elif msg["type"] == "sunsubscribe":
                return -1
        return woken

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.pubsub.close()
        with contextlib.suppress(Exception):
            self.conn.close()


class Wake:
    """The wake channels of one worker's queue shards, one subscription per master."""

    def __init__(self, cluster: Any, url: str, channels: list[str]) -> None:
        self._cluster = cluster  # redis-py's RedisCluster: its slot map finds the masters
        self._credentials = credentials(url)
        self.channels = sorted(set(channels))
        self._subs: list[_Subscription] = []
        self._missing = set(self.channels)  # channels with no confirmed subscription
        self._retry_at = 0.0
        self.messages = 0  # wake-ups received

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a wake-up; True when one came (or this
        cannot tell: a subscription is new or lost, so the caller should sweep)."""
        if self._missing and time.monotonic() >= self._retry_at and self._subscribe():
            return True
        if not self._subs:
            time.sleep(min(timeout, POLL_S))
            return True
        if self._missing:  # try the missing channels again in time
            timeout = min(timeout, max(0.0, self._retry_at - time.monotonic()))
        deadline = time.monotonic() + timeout
        while True:
            woken = self._drain()
            if woken:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(InterruptedError):
                select.select(self._subs, [], [], left)

    def _drain(self) -> bool:
        """Read every subscription's messages; True for a wake-up or a lost subscription."""
        woken = False
        for sub in list(self._subs):
            try:
                got = sub.drain()
                sub.fileno()  # still connected
            except Exception as exc:
                if not is_outage(exc):
                    log.warning("wake channel failed: %r", exc)
                got = -1
            if got < 0:
                self._drop(sub)
            self.messages += max(got, 0)
            woken = woken or got != 0
        return woken

    def _drop(self, sub: _Subscription) -> None:
        sub.close()
        self._subs.remove(sub)
        self._missing.update(sub.channels)

    def _subscribe(self) -> bool:
        """Subscribe the missing channels, one connection per master; True when any was."""
        self._retry_at = time.monotonic() + RETRY_S
        by_master: dict[str, tuple[Any, list[str]]] = {}
        try:
            for channel in sorted(self._missing):
                node = self._cluster.nodes_manager.get_node_from_slot(slot_of(channel))
                by_master.setdefault(node.name, (node, []))[1].append(channel)
        except Exception as exc:
            log.warning("wake channels: no slot map: %r", exc)
            return False
        made = False
        for node, channels in by_master.values():
            sub: _Subscription | None = None
            try:
                sub = _Subscription(node, channels, self._credentials)
                sub.confirm()
            except Exception as exc:
                if not is_outage(exc) and not isinstance(exc, TimeoutError):
                    log.warning("wake channel subscription failed: %r", exc)
                if sub is not None:
                    sub.close()
                continue
            self._subs.append(sub)
            self._missing.difference_update(channels)
            made = True
        return made

    def close(self) -> None:
        for sub in list(self._subs):
            self._drop(sub)


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
