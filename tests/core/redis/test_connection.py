"""The Redis clients the gateway builds, on a real server."""

from __future__ import annotations

import asyncio

from core.redis.connection import connect_async
from core.redis.embedded import EmbeddedRedis


async def test_a_burst_of_concurrent_calls_all_succeed(redis_server: EmbeddedRedis) -> None:
    """Hundreds of concurrent calls (a burst of resumes) all get a connection."""
    redis = connect_async(redis_server.url)
    try:
        replies = await asyncio.gather(*(redis.incr("pool-test") for _ in range(300)))
        assert sorted(replies) == list(range(1, 301))
        await redis.delete("pool-test")
    finally:
        await redis.aclose()
