"""The stream-log bytes each key may hold in Redis, as a gateway checks and settles them.

:class:`LogLedger` reserves a new stream's worst case in its owner's ledger before the
stream exists (``--max-log-bytes-per-key``; 0: no limit), releases it when the stream
could not be created, and settles a stream the gateway itself ends (a cancel before any
worker took it, a stream whose worker died) to its log's size. core/wire/log_ledger.py
has the ledger's keys and scripts; the worker settles the streams it ends
(worker/ledger.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from tokenrelay.core.wire.keys import Keys
from tokenrelay.core.wire.log_ledger import (
    RESERVE_LUA,
    SETTLE_LUA,
    log_bytes,
    reserve_call,
    settle_call,
)
from tokenrelay.gateway.errors import LogBytesFull, RedisUnavailable

log = logging.getLogger("tokenrelay.streamlog")

Guard = Callable[[Awaitable[Any]], Awaitable[Any]]

RETRY_AFTER_MAX = 60.0  # seconds: the longest wait a refusal suggests


def _mb(n: int) -> str:
    return f"{n / 1024**2:.1f} MiB"


class LogLedger:
    """One gateway's reservations and settles of stream-log bytes per owner."""

    def __init__(self, redis: Any, keys: Keys, guard: Guard, limit: int = 0) -> None:
        self.redis = redis
        self.keys = keys
        self.limit = limit  # bytes per owner; 0: none
        self._guard = guard  # the store's: outages become RedisUnavailable
        self._reserve = redis.register_script(RESERVE_LUA)
        self._settle = redis.register_script(SETTLE_LUA)

    async def reserve(self, owner: str | None, stream_id: str, params: Mapping[str, Any]) -> bool:
        """Reserve the worst case of a stream of ``params`` for ``owner``; False when nothing
        was reserved: no limit, or the ledger's Redis (on a cluster, its master) does not
        answer, when the stream goes uncounted as the rate limit lets a request through.
        Raises :class:`LogBytesFull` over the limit."""
        if not owner or self.limit <= 0:
            return False
        want = log_bytes(params)
        keys, args = reserve_call(self.keys, owner, stream_id, want, self.limit)
        try:
            got = await self._guard(self._reserve(keys=keys, args=args))
        except RedisUnavailable:  # the stream's own writes tell whether Redis takes it
            log.debug("stream log bytes not counted", extra={"stream_id": stream_id})
            return False
        if int(got[0]) == 1:
            return True
        held, wait_s = int(got[1]), int(got[2]) / 1000.0
        raise LogBytesFull(
            f"this caller's stream logs hold {_mb(held)} in Redis, and this request could add "
            f"{_mb(min(want, self.limit))}: over the limit of {_mb(self.limit)} per key "
            "(--max-log-bytes-per-key); retry once older streams expire, or ask for fewer "
            "tokens or logprobs",
            retry_after=min(RETRY_AFTER_MAX, max(1.0, wait_s)),
        )

    async def release(self, owner: str, stream_id: str) -> None:
        """Drop a reservation whose stream was not created (best effort)."""
        await self.settle(owner, stream_id, 0.0, size=0)

    async def settle(
        self, owner: str | None, stream_id: str, ttl_s: float, *, size: int | None = None
    ) -> None:
        """The stream ended: its entry holds its log's size (``MEMORY USAGE``; ``size``
        when given) for ``ttl_s`` more seconds. Best effort: a failure leaves the
        reservation, which lapses with the stream's safety expiry."""
        if not owner:
            return
        try:
            if size is None:
                raw = await self._guard(self.redis.memory_usage(self.keys.stream(stream_id), 0))
                size = int(raw or 0)
            keys, args = settle_call(self.keys, owner, stream_id, size, ttl_s)
            await self._guard(self._settle(keys=keys, args=args))
        except RedisUnavailable:
            log.debug("stream log bytes not settled", extra={"stream_id": stream_id})
