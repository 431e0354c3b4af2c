"""A worker on a Redis Cluster with one master down: the others' streams go on.

A pipeline over several masters fails as a whole when one of them does not answer, and
every attempt waits for that master's connection to fail. So a worker writes each
master's share of a step separately (:meth:`Masters.run`): the streams of a master that
is down keep their events in the outbox (worker/outbox.py) until it answers again, and
are written then from the offset Redis confirmed, while the streams of the other masters
are written at every step. A master that failed is left alone for a backoff
(:data:`FIRST_BACKOFF_S`, doubling up to :data:`MAX_BACKOFF_S`) before the next attempt,
so an outage costs the step loop one failed connection now and then, not one a step.
Reads that touch every master (the control stream, the attachment poll, the claims of
dead workers' requests) leave the down master's part out the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from tokenrelay.core.redis.connection import is_outage
from tokenrelay.core.wire.keys import slot_of

log = logging.getLogger("tokenrelay.worker")

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 5.0


class Masters:
    """The masters of one cluster as a worker sees them: which are down, until when."""

    def __init__(self, cluster: Any) -> None:
        self._cluster = cluster  # redis-py's RedisCluster
        self._retry_at: dict[str, float] = {}  # master -> when to try it again
        self._backoff: dict[str, float] = {}

    def of_slot(self, slot: int) -> str:
        """The name (``host:port``) of the master serving ``slot``."""
        return str(self._cluster.nodes_manager.get_node_from_slot(slot).name)

    def of_key(self, key: str) -> str:
        return self.of_slot(slot_of(key))

    def down(self) -> list[str]:
        """The masters that failed and are not answering yet (in their backoff or not)."""
        return sorted(self._backoff)

    def run(self, master: str, fill: Callable[[Any], object]) -> list[Any] | None:
        """The replies of a pipeline on ``master`` (``fill`` queues its commands, whose keys
        it serves), or ``None`` when the master is down: now, or still in its backoff."""
        if time.monotonic() < self._retry_at.get(master, 0.0):
            return None
        pipe = self._cluster.pipeline(transaction=False)
        fill(pipe)
        try:
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:
            if not is_outage(exc):
                raise
            self._failed(master, exc)
            return None
        failed = next((r for r in replies if isinstance(r, Exception) and is_outage(r)), None)
        if failed is not None:
            self._failed(master, failed)
            return None
        if master in self._backoff:
            del self._backoff[master]
            self._retry_at.pop(master, None)
            log.info("redis master answers again", extra={"master": master})
        return list(replies)

    def each(self, keys: list[str], fill: Callable[[Any, str], object]) -> dict[str, Any]:
        """``fill(pipe, key)`` for each key, one pipeline per master: ``{key: reply}`` for
        the keys of masters that answered (one reply per key: ``fill`` queues one command)."""
        by_master: dict[str, list[str]] = {}
        for key in keys:
            by_master.setdefault(self.of_key(key), []).append(key)
        out: dict[str, Any] = {}
        for master, mine in by_master.items():

            def queue(pipe: Any, mine: list[str] = mine) -> None:
                for key in mine:
                    fill(pipe, key)

            replies = self.run(master, queue)
            if replies is not None:
                out.update(zip(mine, replies, strict=True))
        return out

    def _failed(self, master: str, exc: BaseException) -> None:
        backoff = min(MAX_BACKOFF_S, self._backoff.get(master, FIRST_BACKOFF_S / 2) * 2)
        if master not in self._backoff:
            log.warning(
                "redis master down: its streams wait, the others go on",
                extra={"master": master, "error": repr(exc)},
            )
        self._backoff[master] = backoff
        self._retry_at[master] = time.monotonic() + backoff
