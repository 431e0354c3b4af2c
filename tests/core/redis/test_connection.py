"""The Redis clients the gateway builds, on a real server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tokenrelay.core.redis.connection import (
    RedisHealth,
    check_cluster_mode,
    connect_async,
    connect_sync,
    is_full,
    is_outage,
    redact_url,
)
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.redis.local_cluster import LocalCluster

FILLER = "filler:"


def fill(client: redis.Redis) -> int:
    """Write filler keys until Redis refuses one (OOM); returns its ``maxmemory`` before.

    A refused write frees its own buffers, so memory may dip just under the limit and
    let a small write through: the limit is then pinned 256 KiB under what is used,
    and every write is refused until :func:`make_room`.
    """
    limit = int(str(client.config_get("maxmemory")["maxmemory"]))
    assert limit > 0, "this Redis has no maxmemory"
    n = 0
    with contextlib.suppress(redis.OutOfMemoryError):
        while n <= limit // 65536:
            client.set(f"{FILLER}{n}", b"x" * 65536)
            n += 1
    assert n <= limit // 65536, "Redis took more than its maxmemory"
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used - 256 * 1024)
    return limit


def make_room(client: redis.Redis, limit: int) -> None:
    """Delete the filler and give Redis its limit back."""
    keys = list(client.scan_iter(match=f"{FILLER}*", count=1000))
    if keys:
        client.delete(*keys)
    client.config_set("maxmemory", limit)


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


def test_a_full_redis_refuses_writes_reads_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A write refused at maxmemory is "full" (an outage to wait out), in a script too;
    reads still answer and nothing was evicted; :class:`RedisHealth` says so once."""
    with EmbeddedRedis(tmp_path, maxmemory="4mb") as server:
        client = connect_sync(server.url)
        client.set("kept", "v")
        limit = fill(client)
        with pytest.raises(redis.OutOfMemoryError) as plain:
            client.set("more", "v")
        with pytest.raises(redis.ResponseError) as scripted:  # Redis 6: wrapped in ERR
            client.eval("return redis.call('SET', KEYS[1], 'v')", 1, "more")
        for exc in (plain.value, scripted.value):
            assert is_full(exc) and is_outage(exc), exc
        assert not is_full(redis.ResponseError("WRONGTYPE Operation against a key"))
        assert client.get("kept") == b"v" and client.exists(f"{FILLER}0")
        health = RedisHealth("test")
        with caplog.at_level(logging.WARNING, "tokenrelay.redis"):
            for exc in (plain.value, scripted.value, plain.value):
                health.failed(exc)
            make_room(client, limit)
            assert client.set("more", "v")
            health.ok()
        said = [r.getMessage() for r in caplog.records if r.name == "tokenrelay.redis"]
        assert said == ["redis is full (maxmemory): writes are refused", "redis takes writes again"]
        client.close()


def test_cluster_mode_must_match_the_server(
    redis_server: EmbeddedRedis, redis_cluster: LocalCluster
) -> None:
    """--redis-cluster against a plain Redis, or its absence against a cluster node, is a
    clear ValueError at start; matching modes and an unreachable Redis pass."""
    check_cluster_mode(redis_server.url, False)
    check_cluster_mode(redis_cluster.url, True)
    with pytest.raises(ValueError, match="is not a Redis Cluster node"):
        check_cluster_mode(redis_server.url, True)
    with pytest.raises(ValueError, match="add --redis-cluster"):
        check_cluster_mode(redis_cluster.url, False)
    check_cluster_mode("redis://127.0.0.1:1", True)  # not up (yet): waited for later


def test_a_gateway_told_cluster_on_a_plain_redis_says_so(redis_server: EmbeddedRedis) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tokenrelay.core.cli", "gateway", "--redis-url", redis_server.url,
         "--redis-cluster", "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "is not a Redis Cluster node" in out.stderr
