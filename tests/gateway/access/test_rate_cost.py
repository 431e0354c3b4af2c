"""A request of ``n`` choices costs ``n`` rate tokens (the real bucket script in Redis)."""

from __future__ import annotations

import pytest

from tokenrelay.gateway.access.ratelimit import RateLimiter
from tokenrelay.gateway.errors import RateLimited
from tokenrelay.gateway.streams.store import StreamStore


async def test_n_choices_spend_n_tokens(stream_store: StreamStore) -> None:
    limiter = RateLimiter(stream_store.draw_tokens, per_minute=6)  # a bucket of 6
    await limiter.check("key:a", 4)  # four choices
    await limiter.check("key:a", 2)
    with pytest.raises(RateLimited):
        await limiter.check("key:a", 1)  # the bucket is empty
    await limiter.check("key:b", 50)  # more than a bucket holds: the whole bucket
    with pytest.raises(RateLimited):
        await limiter.check("key:b")
