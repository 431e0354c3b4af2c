"""The stream store and the worker store on a real 3-master Redis Cluster.

Requests spread over the queue shards and reach the worker from all of them; each
stream's keys share one slot; live events come from each stream's sharded channel
(no log reads), whose subscription ends with the stream's last subscriber; attachments
and the worker's poll work across slots. (tests/e2e/cluster/ runs whole fleets.)
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis

from tests.gateway.conftest import open_slog, open_wlog
from tests.gateway.streams.test_store import BODY, collect, start_stream, write_done
from tokenrelay.core.redis.local_cluster import LocalCluster
from tokenrelay.core.wire.events import token_fields
from tokenrelay.core.wire.keys import QUEUE_SHARDS, Keys, slot_of
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.gateway.errors import RedisUnavailable
from tokenrelay.gateway.streams.memory import _fullest
from tokenrelay.gateway.streams.store import StreamStore
from tokenrelay.worker.store import Batch, WorkerStore

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cprefix() -> str:
    return f"c{secrets.token_hex(4)}:"


@pytest.fixture
async def cslog(redis_cluster: LocalCluster, cprefix: str) -> AsyncIterator[StreamStore]:
    async with open_slog(redis_cluster.url, cprefix, cluster=True) as log:
        yield log


@pytest.fixture
def cwlog(redis_cluster: LocalCluster, cprefix: str) -> Iterator[WorkerStore]:
    with open_wlog(redis_cluster.url, cprefix, cluster=True) as log:
        yield log


def test_slots_and_queue_shards() -> None:
    assert slot_of("123456789") == 12739  # CRC16/XMODEM, as Redis Cluster's spec says
    assert slot_of("{user1000}.following") == slot_of("{user1000}.followers")
    assert slot_of("foo{}{bar}") == slot_of("foo{}{bar}".replace("{", "{", 1))
    assert slot_of("foo{bar}{zap}") == slot_of("bar")
    keys = Keys("tr:", cluster=True)
    shards = keys.queue_shards("m")
    assert len(shards) == QUEUE_SHARDS == len(set(shards))
    slots = [slot_of(q) for q in shards]
    assert [s * QUEUE_SHARDS // 16384 for s in slots] == list(range(QUEUE_SHARDS))
    assert [slot_of(w) for w in keys.wakes("m")] == slots  # each wakes in its shard's slot
    assert keys.wakes("m") == [q.replace(":requests:", ":wake:") for q in shards]
    assert Keys("tr:").queue_shards("m") == ["tr:requests:m"]
    sid = "a" * 22
    assert len({slot_of(k) for k in (keys.stream(sid), keys.meta(sid), keys.attach(sid))}) == 1
    assert slot_of(keys.channel(sid)) == slot_of(keys.stream(sid))
    with pytest.raises(ValueError, match="braces"):
        Keys("t{x}:")


def test_fullest_master_counts() -> None:
    infos: list[dict[str, Any]] = [
        {"used_memory": 10, "maxmemory": 100, "maxmemory_policy": "noeviction"},
        {"used_memory": 95, "maxmemory": 100, "maxmemory_policy": "noeviction"},
        {"used_memory": 99, "maxmemory": 100, "maxmemory_policy": "allkeys-lru"},
        {"used_memory": 50, "maxmemory": 0},
    ]
    assert _fullest(infos) == (95, 100)
    assert _fullest(infos[2:]) == (0, 0)


async def test_requests_spread_over_shards_and_all_reach_the_worker(
    cslog: StreamStore, cwlog: WorkerStore, redis_cluster: LocalCluster
) -> None:
    assert await cslog.live_workers(max_age=0) == ["w-test"]
    created = {(await cslog.create(BODY, f"r{i}")).stream_id for i in range(48)}
    client = redis.RedisCluster.from_url(redis_cluster.url)
    lengths = [client.xlen(q) for q in cwlog.queues]
    assert sum(lengths) == 48 and sum(1 for n in lengths if n) >= 8, lengths
    got: set[str] = set()
    for _ in range(40):
        got |= {r.stream_id for r in cwlog.read_requests(64, 50)}
        if got == created:
            break
    assert got == created
    assert cwlog.read_new(64) == []


async def test_live_events_come_from_each_streams_channel(
    cslog: StreamStore, cwlog: WorkerStore, redis_cluster: LocalCluster
) -> None:
    sids = [(await start_stream(cslog, cwlog))[0] for _ in range(6)]
    tails = [asyncio.create_task(collect(cslog, sid, 0)) for sid in sids]
    for _ in range(300):  # every channel confirmed: the feed covers them
        if all(cslog.tailer.feed.covers(sid) for sid in sids):
            break
        await asyncio.sleep(0.01)
    assert all(cslog.tailer.feed.covers(sid) for sid in sids)
    await asyncio.sleep(0.1)
    reads, messages = cslog.tailer.catch_up_reads, cslog.tailer.feed.messages

    def write_all() -> None:
        for seq in range(1, 41):
            batches = [Batch(sid, seq, [token_fields(f"{sid}:{seq}")]) for sid in sids]
            assert [r.status for r in cwlog.flush(batches)] == [1] * len(sids)
        for sid in sids:
            write_done(cwlog, sid, 41)

    await asyncio.get_running_loop().run_in_executor(None, write_all)
    for sid, tail in zip(sids, tails, strict=True):
        events = await asyncio.wait_for(tail, 10)
        assert [e.seq for e in events] == list(range(1, 42))
        assert [e.text for e in events[:-1]] == [f"{sid}:{s}" for s in range(1, 41)]
    assert cslog.tailer.feed.messages - messages >= 6 * 41
    assert cslog.tailer.catch_up_reads - reads <= 12  # the feed served them, not the logs
    client = redis.RedisCluster.from_url(redis_cluster.url)
    channels = [cslog.keys.channel(sid) for sid in sids]
    for _ in range(100):  # the last subscriber gone: unsubscribed
        counts = [
            client.pubsub_shardnumsub(ch, target_nodes=client.get_node_from_key(ch))
            for ch in channels
        ]
        if all(n == 0 for [(_, n)] in counts):
            break
        await asyncio.sleep(0.02)
    assert all(n == 0 for [(_, n)] in counts), counts


async def test_attachments_and_poll_across_slots(cslog: StreamStore, cwlog: WorkerStore) -> None:
    sids = [(await start_stream(cslog, cwlog))[0] for _ in range(12)]
    ids = [await cslog.attach(sid) for sid in sids]
    await cslog.attachments._call(list(cslog.attachments.tracked.items()))  # a refresh
    # each stream: its creator's attachment and the one made here
    assert cwlog.poll(sids) == dict.fromkeys(sids, (2, False))
    await asyncio.gather(*(cslog.detach(sid, aid) for sid, aid in zip(sids, ids, strict=True)))
    assert cslog.disconnects == 12
    assert cwlog.poll(sids) == dict.fromkeys(sids, (1, False))
    await cslog.cancel(sids[0])
    assert cwlog.poll(sids[:1]) == {sids[0]: (1, True)}


def _xreadgroup_calls(client: redis.RedisCluster) -> int:
    stats = client.info("commandstats", target_nodes=client.PRIMARIES)
    return sum(int(s.get("cmdstat_xreadgroup", {}).get("calls", 0)) for s in stats.values())


async def test_an_idle_worker_waits_for_a_wake_up_not_a_poll(
    cslog: StreamStore, cwlog: WorkerStore, redis_cluster: LocalCluster
) -> None:
    """Between sweeps of its 16 queue shards an idle worker waits on the wake channel: a
    request queued meanwhile wakes it long before its wait ends, and while nothing comes
    it sweeps once per wait, not in a loop."""
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, cwlog.read_requests, 64, 200) == []  # subscribes
    client = redis.RedisCluster.from_url(redis_cluster.url)
    before = _xreadgroup_calls(client)
    assert await loop.run_in_executor(None, cwlog.read_requests, 64, 1000) == []
    assert _xreadgroup_calls(client) - before <= QUEUE_SHARDS  # one sweep: no polling
    waiting = loop.run_in_executor(None, cwlog.read_requests, 64, 30_000)
    await asyncio.sleep(0.3)
    new = await cslog.create(BODY, "woken")
    got = await asyncio.wait_for(waiting, 20)  # well before the 30 s wait would end
    assert [r.stream_id for r in got] == [new.stream_id]


def _live_xreadgroup_calls(cluster: LocalCluster, down: int) -> int:
    """``XREADGROUP`` calls so far on every master but ``down``."""
    stats = [cluster.client(i).info("commandstats") for i in range(len(cluster.ports)) if i != down]
    return sum(int(s.get("cmdstat_xreadgroup", {}).get("calls", 0)) for s in stats)


def _prefix_off(cluster: LocalCluster, client: redis.RedisCluster) -> tuple[str, int]:
    """A key prefix and a master (the one of the first queue shard's wake channel) that
    holds none of the prefix's worker keys, so the worker stays live with it down."""

    def master(key: str) -> int:
        return cluster.ports.index(int(client.get_node_from_key(key).port))

    for _ in range(200):
        prefix = f"w{secrets.token_hex(3)}:"
        keys = Keys(prefix, cluster=True)
        down = master(keys.wakes(None)[0])
        if down not in (master(keys.workers), master(keys.worker("w-test"))):
            return prefix, down
    raise AssertionError("no prefix found")


async def test_streams_are_created_while_a_wake_channels_master_is_down(
    fresh_redis_cluster: LocalCluster,
) -> None:
    """The wake-up is published best effort after the request is queued: with a master
    down, a stream whose own keys and queue shard live elsewhere is created and its
    request reaches the worker (which sweeps its queues)."""
    cluster = fresh_redis_cluster
    prefix, down = _prefix_off(cluster, redis.RedisCluster.from_url(cluster.url))
    with open_wlog(cluster.url, prefix, cluster=True) as worker:
        async with open_slog(cluster.url, prefix, cluster=True) as gateway:
            assert await gateway.live_workers(max_age=0) == ["w-test"]
            cluster.kill(down)
            created: set[str] = set()
            for i in range(24):
                worker.heartbeat(WorkerStats())  # a live worker's beat (its TTL is 3 s)
                with contextlib.suppress(RedisUnavailable):  # its own keys on the dead master
                    created.add((await gateway.create(BODY, f"r{i}")).stream_id)
            assert len(created) >= 8, created  # two masters of three still take streams
            got: set[str] = set()
            for _ in range(40):
                with contextlib.suppress(redis.RedisError):
                    got |= {r.stream_id for r in worker.read_requests(64, 50)}
                if created <= got:
                    break
            assert created <= got


async def test_wake_channels_spread_over_the_masters_and_outlive_one(
    fresh_redis_cluster: LocalCluster,
) -> None:
    """Every master holds some queue shards' wake channels. With one master down an idle
    worker keeps waiting on the others' channels (a wait lasts, it does not turn into a
    poll) and is woken by a request queued on a live master's shard."""
    cluster = fresh_redis_cluster
    client = redis.RedisCluster.from_url(cluster.url)
    masters = {client.get_node_from_key(w).name for w in Keys("x:", cluster=True).wakes("m")}
    assert len(masters) == len(cluster.ports) == 3
    prefix, down = _prefix_off(cluster, client)
    loop = asyncio.get_running_loop()
    with open_wlog(cluster.url, prefix, cluster=True) as worker:
        async with open_slog(cluster.url, prefix, cluster=True) as gateway:
            assert await gateway.live_workers(max_age=0) == ["w-test"]
            assert await loop.run_in_executor(None, worker.read_requests, 64, 200) == []
            cluster.kill(down)
            await loop.run_in_executor(None, worker.read_requests, 64, 200)  # sees it go
            calls = _live_xreadgroup_calls(cluster, down)
            for _ in range(3):
                worker.heartbeat(WorkerStats())
                assert await loop.run_in_executor(None, worker.read_requests, 64, 1000) == []
            # one sweep a read: it waited on the live masters' channels, not polling
            assert _live_xreadgroup_calls(cluster, down) - calls <= 3 * QUEUE_SHARDS
            assert worker.shards is not None and worker.shards._wake is not None
            woken = worker.shards._wake.messages

            def read_until_some() -> set[str]:
                for _ in range(20):
                    got = {r.stream_id for r in worker.read_requests(64, 1000)}
                    if got:
                        worker.read_requests(64, 200)  # the wake-up read, if a sweep came first
                        return got
                return set()

            waiting = loop.run_in_executor(None, read_until_some)
            await asyncio.sleep(0.2)
            new = None
            for i in range(10):
                worker.heartbeat(WorkerStats())
                with contextlib.suppress(RedisUnavailable):  # its keys on the dead master
                    new = await gateway.create(BODY, f"r{i}")
                    break
            assert new is not None
            assert await asyncio.wait_for(waiting, 30) == {new.stream_id}
            assert worker.shards._wake.messages > woken
