"""Whether Redis has room for new streams: refuse them before it is full.

A Redis with a ``maxmemory`` and the ``noeviction`` policy (the embedded one,
core/redis/embedded.py) never drops a key: once full, it refuses every write, so
the streams already running could not append their next events. A gateway keeps
their room: it refuses *new* streams (``overloaded``) once Redis' ``used_memory``
reaches :data:`ADMIT_BELOW` of its ``maxmemory``, which leaves the last tenth to
the events of running streams, until finished streams expire (``--stream-ttl``)
and free memory. ``INFO memory`` is read at most every :data:`MAX_AGE` seconds.

On a Redis Cluster every master is read and the fullest one counts: a stream lands on
any shard, so new streams wait while one of them is nearly full.

A Redis with no limit, or one that evicts (its operator's choice: it may then drop
streams), is never counted full here; a write it refuses still becomes
:class:`RedisFull` in the stream store.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis
import redis.asyncio as aioredis

from tokenrelay.core.redis.connection import is_cluster, is_outage

log = logging.getLogger("tokenrelay.gateway")

ADMIT_BELOW = 0.9  # of maxmemory: new streams are refused from here on
MAX_AGE = 1.0  # seconds an INFO reading is used for

Guard = Callable[[Awaitable[Any]], Awaitable[Any]]


class MemoryGauge:
    """Reads Redis' memory use; :meth:`full` says when new streams must wait."""

    def __init__(
        self,
        client: aioredis.Redis,
        guard: Guard,
        *,
        admit_below: float | None = ADMIT_BELOW,
        max_age: float = MAX_AGE,
    ) -> None:
        self.redis = client
        self._guard = guard  # outages become RedisUnavailable
        self.admit_below = admit_below  # None: never refuse here
        self.max_age = max_age
        self.used = self.limit = 0  # bytes, at the last reading
        self._full = False
        self._at = -math.inf  # when it was read (monotonic)

    async def _masters_memory(self) -> list[Any]:
        """Each reachable master's memory INFO: a master that is down leaves out only itself
        (its own streams fail on their own), unless none answers."""
        cluster: Any = self.redis
        masters = cluster.get_primaries()
        got = await asyncio.gather(
            *(cluster.info("memory", target_nodes=m) for m in masters), return_exceptions=True
        )
        failed = [g for g in got if isinstance(g, BaseException)]
        for exc in failed:
            if not is_outage(exc):
                raise exc
        if len(failed) == len(got):
            raise failed[0]
        return [g for g in got if not isinstance(g, BaseException)]

    async def full(self) -> bool:
        """True while Redis is at :data:`ADMIT_BELOW` of its limit (noeviction only)."""
        if self.admit_below is None:
            return False
        if time.monotonic() - self._at < self.max_age:
            return self._full
        try:
            if is_cluster(self.redis):
                infos = await self._guard(self._masters_memory())
            else:
                infos = [await self._guard(self.redis.info("memory"))]
        except redis.ResponseError as exc:  # INFO refused (a managed Redis): stop asking
            log.warning("redis memory use is unknown (INFO refused): %s", str(exc)[:200])
            self.admit_below = None
            return False
        self._at = time.monotonic()
        self.used, self.limit = _fullest([i for i in infos if isinstance(i, dict)])
        full = self.limit > 0 and self.used >= self.limit * self.admit_below
        if full != self._full:
            self._full = full
            extra = {"used_memory": self.used, "maxmemory": self.limit}
            if full:
                log.warning("redis is nearly full: new streams are refused", extra=extra)
            else:
                log.warning("redis has room again: new streams are taken", extra=extra)
        return full


def _fullest(infos: list[dict[str, Any]]) -> tuple[int, int]:
    """``(used_memory, maxmemory)`` of the fullest ``noeviction`` server; (0, 0): none."""
    best, fill = (0, 0), -1.0
    for info in infos:
        used, limit = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
        if limit <= 0 or str(info.get("maxmemory_policy", "noeviction")) != "noeviction":
            continue
        if used / limit > fill:
            best, fill = (used, limit), used / limit
    return best
