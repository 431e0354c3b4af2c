"""Per-key limits: requests per minute (shared by all gateways) and concurrent streams.

:class:`RateLimiter` is a token bucket kept in Redis and updated by one Lua
script, so every gateway of a deployment draws from the same bucket: a key
with ``--rate-limit 60`` gets 60 requests per minute however the load
balancer spreads them. The script uses Redis' own clock (``TIME``), so
gateways with skewed clocks agree. A refused request learns how long until
the next token (``Retry-After``).

:class:`StreamSlots` counts the streams each key has open on this gateway
(``--max-streams-per-key``), over the WebSocket and the HTTP API together.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tokenrelay.gateway.errors import RateLimited, RedisUnavailable

# the store's draw: (bucket, capacity, tokens per ms, cost) -> (allowed, wait s, left)
Draw = Callable[[str, int, float, int], Awaitable[tuple[bool, float, int]]]

log = logging.getLogger("tokenrelay.ratelimit")


@dataclass(frozen=True)
class Verdict:
    """The answer of :meth:`RateLimiter.take`."""

    allowed: bool
    retry_after: float  # seconds until a request would be allowed (0 when allowed)
    remaining: int


class RateLimiter:
    """A Redis token bucket per key: ``per_minute`` refill, ``burst`` capacity."""

    def __init__(self, draw: Draw, per_minute: float, burst: int = 0) -> None:
        self.per_minute = per_minute
        self.capacity = burst or max(1, math.ceil(per_minute))
        self._draw: Draw | None = draw if per_minute > 0 else None

    @property
    def enabled(self) -> bool:
        return self._draw is not None

    async def take(self, bucket: str, cost: int = 1) -> Verdict:
        """Draw ``cost`` tokens from ``bucket``; allowed when Redis is unreachable."""
        if self._draw is None:
            return Verdict(True, 0.0, self.capacity)
        try:
            allowed, wait, left = await self._draw(
                bucket, self.capacity, self.per_minute / 60_000.0, cost
            )
        except RedisUnavailable:  # the request itself will report the outage
            return Verdict(True, 0.0, 0)
        return Verdict(allowed, wait, left)

    async def check(self, bucket: str, cost: int = 1) -> None:
        """Raise :class:`RateLimited` when ``bucket`` lacks ``cost`` tokens (a request of
        more than the bucket holds costs the whole bucket)."""
        verdict = await self.take(bucket, max(1, min(cost, self.capacity)))
        if not verdict.allowed:
            limit = f"{self.per_minute:g} requests per minute"
            raise RateLimited(f"rate limit of {limit} reached", verdict.retry_after)


class StreamSlots:
    """Concurrent streams per key (or address) on this gateway."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active: dict[str, int] = {}

    def acquire(self, bucket: str) -> bool:
        """Take a slot for ``bucket``; False when it already has ``limit`` streams."""
        n = self.active.get(bucket, 0)
        if n >= self.limit:
            return False
        self.active[bucket] = n + 1
        return True

    def release(self, bucket: str) -> None:
        n = self.active.get(bucket, 0) - 1
        if n > 0:
            self.active[bucket] = n
        else:
            self.active.pop(bucket, None)
