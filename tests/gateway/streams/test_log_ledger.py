"""The stream-log bytes one key may hold in Redis (``--max-log-bytes-per-key``), on a real
Redis: reserved when a stream is created, refused past the limit with ``overloaded``
(other keys unaffected), settled to the log's size by whoever writes its end, and gone
when the log expires (core/wire/log_ledger.py, gateway/streams/ledger.py,
worker/ledger.py)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
import redis

from tests.gateway.conftest import open_slog, open_wlog
from tests.gateway.streams.test_store import BODY, write_done
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.redis.local_cluster import LocalCluster
from tokenrelay.core.wire.events import accepted_fields, token_fields
from tokenrelay.core.wire.keys import Keys, slot_of
from tokenrelay.core.wire.log_ledger import log_bytes
from tokenrelay.core.wire.logprobs import Logprobs, TokenLogprob, encode_logprobs
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.core.wire.vocabulary import ErrorCode
from tokenrelay.gateway.access.auth import SecuritySettings, log_bytes_limit
from tokenrelay.gateway.errors import LogBytesFull, Overloaded, RedisUnavailable, refusal
from tokenrelay.gateway.streams.store import StreamStore
from tokenrelay.worker.store import Batch, WorkerStore

ONE = log_bytes(BODY["params"])  # what one stream of BODY reserves


async def begin(store: StreamStore, worker: WorkerStore, owner: str) -> str:
    """A stream of ``owner`` taken by the worker (its accepted marker written)."""
    new = await store.create(BODY, "r", owner=owner)
    assert [r.stream_id for r in worker.read_requests(10, None)] == [new.stream_id]
    meta = {"st": "running", "w": "w-test", "pt": "3"}
    res = worker.flush([Batch(new.stream_id, 0, [accepted_fields(3, "w-test")], meta)])
    assert res[0] is not None and res[0].status == 1
    return new.stream_id


def held(r: redis.Redis, store: StreamStore, owner: str) -> dict[str, int]:
    """An owner's ledger: stream id -> bytes, and "" -> the total."""
    raw: Any = r.hgetall(store.keys.ledger(owner)[1])
    return {k.decode(): int(v) for k, v in raw.items()}


def test_the_reservation_covers_a_log_of_long_logprobs(redis_server: EmbeddedRedis) -> None:
    """The worst case reserved for a request is at least what its log takes in Redis with
    every token long and carrying 20 alternatives (MEMORY USAGE)."""
    r = redis.Redis.from_url(redis_server.url)
    key = "t-ledger-size"
    r.delete(key)
    for i in range(300):
        tok = TokenLogprob(f"{'x' * 15}{i:03d}", -1.2345678, b"x" * 18)
        top = tuple(
            TokenLogprob(f"{'y' * 15}{k:03d}\ufffd", -2.3456789, b"\xff" * 3) for k in range(20)
        )
        f = token_fields(tok.token, encode_logprobs(i * 18, [Logprobs(tok, top)]), [123456 + i])
        r.xadd(key, dict(zip(f[0::2], f[1::2], strict=True)), id=f"{i}-1")
    size = int(r.memory_usage(key, samples=0) or 0)
    assert size < log_bytes({"max_tokens": 300, "logprobs": 20})
    assert log_bytes({"max_tokens": 300}) < log_bytes({"max_tokens": 300, "logprobs": 0}) < size
    r.delete(key)


async def test_a_key_over_its_log_bytes_is_refused_and_no_other(
    stream_store: StreamStore, worker_store: WorkerStore, redis_server: EmbeddedRedis
) -> None:
    r = redis.Redis.from_url(redis_server.url)
    stream_store.ledger.limit = 3 * ONE
    made = [await stream_store.create(BODY, f"r{i}", owner="key:a") for i in range(3)]
    assert held(r, stream_store, "key:a")[""] == 3 * ONE
    with pytest.raises(LogBytesFull) as info:
        await stream_store.create(BODY, "r4", owner="key:a")
    assert isinstance(info.value, Overloaded)
    said = refusal(info.value)
    assert said.code == ErrorCode.OVERLOADED and said.retry_after is not None
    assert "--max-log-bytes-per-key" in said.message and "per key" in said.message
    assert len(made) == 3 and held(r, stream_store, "key:a")[""] == 3 * ONE
    assert r.xlen(stream_store.keys.requests) == 3  # nothing queued
    # another key, and a caller no limit counts (loopback without keys), are served
    await stream_store.create(BODY, "rb", owner="key:b")
    await stream_store.create(BODY, "rn", owner=None)
    assert held(r, stream_store, "key:b")[""] == ONE
    # a request larger than the whole limit reserves the limit: served when nothing else is
    big = {"prompt": "hi", "params": {"max_tokens": 100_000, "logprobs": 20}}
    await stream_store.create(big, "rc", owner="key:c")
    assert held(r, stream_store, "key:c")[""] == 3 * ONE


async def test_an_ended_stream_holds_its_log_size_until_it_expires(
    stream_store: StreamStore, worker_store: WorkerStore, redis_server: EmbeddedRedis
) -> None:
    """The worker that writes the done event settles the entry to the log's own size, held
    as long as the log lives; then the key has room again."""
    r = redis.Redis.from_url(redis_server.url)
    stream_store.ledger.limit = 2 * ONE
    sid = await begin(stream_store, worker_store, "key:a")
    other = await begin(stream_store, worker_store, "key:a")
    with pytest.raises(LogBytesFull):
        await stream_store.create(BODY, "r3", owner="key:a")
    write_done(worker_store, sid, 1, ttl=0.5)  # its log lives half a second
    size = int(r.memory_usage(stream_store.keys.stream(sid), samples=0) or 0)
    assert 0 < size < ONE
    assert held(r, stream_store, "key:a") == {sid: size, other: ONE, "": size + ONE}
    await asyncio.sleep(0.7)  # the log expired: its entry goes at the next reservation
    third = await stream_store.create(BODY, "r3", owner="key:a")
    assert held(r, stream_store, "key:a") == {other: ONE, third.stream_id: ONE, "": 2 * ONE}


async def test_the_gateway_settles_the_streams_it_ends(
    stream_store: StreamStore, worker_store: WorkerStore, redis_server: EmbeddedRedis
) -> None:
    """A stream cancelled before any worker took it ends at the gateway, which settles it."""
    r = redis.Redis.from_url(redis_server.url)
    stream_store.ledger.limit = 2 * ONE
    new = await stream_store.create(BODY, "r1", owner="key:a")
    await stream_store.cancel(new.stream_id)
    size = int(r.memory_usage(stream_store.keys.stream(new.stream_id), samples=0) or 0)
    assert 0 < size < ONE and held(r, stream_store, "key:a") == {new.stream_id: size, "": size}


async def test_a_worker_settles_later_what_it_could_not_settle(
    stream_store: StreamStore, worker_store: WorkerStore, redis_server: EmbeddedRedis
) -> None:
    r = redis.Redis.from_url(redis_server.url)
    stream_store.ledger.limit = 4 * ONE
    sid = await begin(stream_store, worker_store, "key:a")
    ledger = worker_store.appender.ledger
    ledger.waiting = [(sid, 30.0)]  # as if Redis had not answered at its end
    worker_store.flush([Batch(sid, 1, [token_fields("x")])])  # the next append retries it
    assert ledger.waiting == []
    size = int(r.memory_usage(stream_store.keys.stream(sid), samples=0) or 0)
    assert held(r, stream_store, "key:a") == {sid: size, "": size}


def test_the_limit_is_a_memory_size() -> None:
    assert log_bytes_limit(None) == 256 * 1024**2 == SecuritySettings().max_log_bytes
    assert log_bytes_limit("1gb") == 1024**3 and log_bytes_limit("0") == 0
    for bad in ("lots", "-1", "512k"):
        with pytest.raises(ValueError, match="--max-log-bytes-per-key"):
            log_bytes_limit(bad)


async def test_on_a_cluster_the_ledger_lives_in_its_owners_slot(
    redis_cluster: LocalCluster, prefix: str
) -> None:
    """The owner's ledger is one slot of its own, apart from the streams' slots: reserved
    by the gateway, settled by the worker's pipeline to that slot's master."""
    client = redis.RedisCluster.from_url(redis_cluster.url)
    with open_wlog(redis_cluster.url, prefix, cluster=True) as worker:
        async with open_slog(redis_cluster.url, prefix, cluster=True) as store:
            store.ledger.limit = 8 * ONE
            sids = [await begin(store, worker, "key:a") for _ in range(4)]
            ledger, counts = store.keys.ledger("key:a")
            assert slot_of(ledger) == slot_of(counts)
            for sid in sids:
                write_done(worker, sid, 1)
            sizes = {
                sid: int(client.memory_usage(store.keys.stream(sid), samples=0)) for sid in sids
            }
            raw: Any = client.hgetall(counts)
            assert {k.decode(): int(v) for k, v in raw.items()} == {
                **sizes,
                "": sum(sizes.values()),
            }


async def test_with_the_ledgers_master_down_streams_go_uncounted(
    fresh_redis_cluster: LocalCluster, prefix: str
) -> None:
    """A cluster master down takes only its own streams: a key whose ledger lives there
    still creates streams on the other masters, uncounted (as the rate limit lets requests
    through while Redis does not answer)."""
    cluster = fresh_redis_cluster
    client = redis.RedisCluster.from_url(cluster.url)

    def master(key: str) -> str:
        return str(client.get_node_from_key(key).name)

    keys = Keys(prefix, cluster=True)
    owner = next(
        f"key:{i:04x}"
        for i in range(1000)
        if master(keys.ledger(f"key:{i:04x}")[0])
        not in (master(keys.workers), master(keys.worker("w-test")))
    )
    down = next(p for p in cluster.ports if master(keys.ledger(owner)[0]).endswith(f":{p}"))
    with open_wlog(cluster.url, prefix, cluster=True) as worker:
        async with open_slog(cluster.url, prefix, cluster=True) as store:
            store.ledger.limit = 2 * ONE
            # a serving gateway's client knows the cluster's nodes: one that first connects
            # after its URL's node died has no other node to ask (redis-py >= 8 says so)
            assert await store.ping()
            cluster.kill(cluster.ports.index(down))
            made = []
            for i in range(12):
                worker.heartbeat(WorkerStats())
                with contextlib.suppress(RedisUnavailable):  # its own keys on the dead master
                    made.append(await store.create(BODY, f"r{i}", owner=owner))
            assert len(made) >= 3  # more than the limit would take: not counted
