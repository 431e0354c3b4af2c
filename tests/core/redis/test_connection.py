"""The Redis clients the gateway builds, on a real server."""

from __future__ import annotations

import asyncio

import pytest

from core.redis.connection import connect_async, redact_url
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


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:s3cret@redis:6379/0", "redis://:***@redis:6379/0"),
        ("rediss://app:s3cret@cache.example:6380/2?ssl_cert_reqs=none",
         "rediss://app:***@cache.example:6380/2?ssl_cert_reqs=none"),
        ("redis://:p%40ss@[::1]:6379", "redis://:***@[::1]:6379"),
        ("unix:///tmp/redis.sock?db=0", "unix:///tmp/redis.sock?db=0"),
    ],
)  # fmt: skip
def test_redact_url_hides_the_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
