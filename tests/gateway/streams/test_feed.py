"""The live feed: published appends reach subscribers without reading the logs,
and whatever the feed misses (lost connection, undecodable message, a slow
subscriber) is read from the logs, with no gap and no duplicate.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from tests.gateway.streams.test_store import collect, start_stream, write_done, write_tokens
from tokenrelay.core.wire.events import Event, token_fields
from tokenrelay.core.wire.ids import new_stream_id
from tokenrelay.core.wire.scripts import APPEND_CHUNK
from tokenrelay.gateway.streams import feed as livefeed
from tokenrelay.gateway.streams.store import StreamStore
from tokenrelay.gateway.streams.subscription import BUFFER_LIMIT
from tokenrelay.worker.store import Batch, WorkerStore

pytestmark = pytest.mark.timeout(120)  # a hang here fails fast, with every task's stack


@pytest.fixture(autouse=True)
def no_shedding(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded test machine must not drop the feed for lag (one test turns it back on)."""
    monkeypatch.setattr(livefeed, "SHED_LAG", 60.0)


async def feed_up(stream_store: StreamStore) -> None:
    for _ in range(200):
        if stream_store.tailer.feed.up:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the live feed did not come up")


async def test_published_events_need_no_log_reads(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    await feed_up(stream_store)
    sid, _ = await start_stream(stream_store, worker_store)
    tail = asyncio.create_task(collect(stream_store, sid, 0))
    await asyncio.sleep(0.1)
    reads = stream_store.tailer.catch_up_reads
    for seq in range(1, 201):
        write_tokens(worker_store, sid, seq, [f"<{seq}>"])
        await asyncio.sleep(0)
    write_done(worker_store, sid, 201)
    events = await asyncio.wait_for(tail, 5)
    assert [e.seq for e in events] == list(range(1, 202))
    assert all(e.text == f"<{e.seq}>" for e in events[:-1])
    # 201 appends, served from the feed: at most a couple of catch-up reads (none needed)
    assert stream_store.tailer.catch_up_reads - reads <= 2
    assert stream_store.tailer.feed.messages >= 201


async def test_one_message_per_flush_carries_every_stream(
    stream_store: StreamStore, worker_store: WorkerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(livefeed, "SHED_PAUSE", 0.2)
    sids = [
        (await start_stream(stream_store, worker_store))[0] for _ in range(300)
    ]  # > one APPEND_CHUNK
    subs = [stream_store.tailer.subscribe(sid, 0) for sid in sids]  # (no 300 concurrent replays)
    try:
        await asyncio.sleep(0.3)
        # (the blocking calls above may have held the loop long enough to drop the feed)
        await feed_up(stream_store)
        await asyncio.sleep(0.3)
        before = stream_store.tailer.feed.messages

        def write_all() -> None:  # in a thread: the event loop stays free meanwhile
            for seq in range(1, 4):
                batches = [Batch(sid, seq, [token_fields(f"{sid}:{seq}")]) for sid in sids]
                assert [r.status for r in worker_store.flush(batches)] == [1] * len(sids)
            for sid in sids:
                write_done(worker_store, sid, 4)

        await asyncio.get_running_loop().run_in_executor(None, write_all)
        for sid, sub in zip(sids, subs, strict=True):
            got: list[Event] = []
            while len(got) < 4:
                got += await asyncio.wait_for(sub.get(), 10)
            assert [e.text for e in got[:3]] == [f"{sid}:{s}" for s in (1, 2, 3)]
            assert got[3].kind == "done"
        chunks = -(-len(sids) // APPEND_CHUNK)
        assert stream_store.tailer.feed.messages - before == 3 * chunks + len(sids)
    finally:
        for sub in subs:
            stream_store.tailer.unsubscribe(sub)


async def test_lost_feed_connection_loses_nothing(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    """The feed's connection is killed again and again while a writer appends."""
    await feed_up(stream_store)
    sid, _ = await start_stream(stream_store, worker_store)
    total = 1500
    stop = threading.Event()

    def writer() -> None:
        for first in range(1, total, 5):
            write_tokens(worker_store, sid, first, [f"<{s}>" for s in range(first, first + 5)])
            time.sleep(0.001)
        write_done(worker_store, sid, total + 1)

    async def killer() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.05)
            await stream_store.redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")

    thread = threading.Thread(target=writer)
    tail = asyncio.create_task(collect(stream_store, sid, 0))
    kill = asyncio.create_task(killer())
    thread.start()
    try:
        events = await asyncio.wait_for(tail, 30)
    finally:
        stop.set()
        await kill
        thread.join()
    assert [e.seq for e in events] == list(range(1, total + 2))
    assert all(e.text == f"<{e.seq}>" for e in events[:-1])
    await feed_up(stream_store)  # and it comes back


async def test_undecodable_messages_fall_back_to_the_log(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    await feed_up(stream_store)
    sid, _ = await start_stream(stream_store, worker_store)
    tail = asyncio.create_task(collect(stream_store, sid, 0))
    await asyncio.sleep(0.1)
    junk = [
        b"not json",
        b"[1, 2]",
        json.dumps([1, [[sid, 1, "x"]]]).encode(),
        json.dumps([1, [[sid, 1, [["k", "t", "x"]]]]]).encode(),  # odd field list
        b"\xff\xfe",
    ]
    for message in junk:
        await stream_store.redis.publish(stream_store.keys.events, message)
    await asyncio.sleep(0.1)
    write_tokens(worker_store, sid, 1, ["a", "b"])
    write_done(worker_store, sid, 3)
    events = await asyncio.wait_for(tail, 5)
    assert [(e.seq, e.text) for e in events] == [(1, "a"), (2, "b"), (3, "")]
    assert stream_store.tailer.feed.up


async def test_a_feed_far_behind_is_dropped_for_a_while(
    stream_store: StreamStore, worker_store: WorkerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway that cannot keep up reads the logs in batches instead; nothing is lost."""
    await feed_up(stream_store)
    monkeypatch.setattr(livefeed, "SHED_LAG", 0.5)
    monkeypatch.setattr(livefeed, "SHED_PAUSE", 0.3)
    sid, _ = await start_stream(stream_store, worker_store)
    tail = asyncio.create_task(collect(stream_store, sid, 0))
    await asyncio.sleep(0.1)
    write_tokens(worker_store, sid, 1, ["a"])
    await asyncio.sleep(0.1)
    # a message that Redis sent 5 s ago (as if it had waited in the feed all that time)
    other = new_stream_id()
    late = json.dumps([int(time.time() * 1000) - 5000, [[other, 1, [["k", "t", "x", "z"]]]]])
    await stream_store.redis.publish(stream_store.keys.events, late)
    write_tokens(worker_store, sid, 2, ["b", "c"])
    write_done(worker_store, sid, 4)
    events = await asyncio.wait_for(tail, 5)
    assert [(e.seq, e.text) for e in events] == [(1, "a"), (2, "b"), (3, "c"), (4, "")]
    assert stream_store.tailer.feed.sheds == 1
    await feed_up(stream_store)  # and it comes back


async def test_slow_subscriber_overflow_is_read_from_the_log(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    await feed_up(stream_store)
    sid, _ = await start_stream(stream_store, worker_store)
    sub = stream_store.tailer.subscribe(sid, 0)
    try:
        await asyncio.sleep(0.1)
        assert not sub.lagging
        total = (2 * BUFFER_LIMIT // 50 + 2) * 50  # twice what the buffer holds, and more
        for first in range(1, total, 50):
            write_tokens(worker_store, sid, first, ["x"] * 50)
        await asyncio.sleep(0.2)
        assert len(sub.buffer) == BUFFER_LIMIT and sub.lagging
        got: list[int] = []
        while len(got) < total:
            got += [e.seq for e in await asyncio.wait_for(sub.get(), 2)]
        assert got == list(range(1, total + 1))
    finally:
        stream_store.tailer.unsubscribe(sub)
