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


async def feed_up(slog: StreamStore) -> None:
    for _ in range(200):
        if slog.tailer.feed.up:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the live feed did not come up")


async def test_published_events_need_no_log_reads(slog: StreamStore, wlog: WorkerStore) -> None:
    await feed_up(slog)
    sid, _ = await start_stream(slog, wlog)
    tail = asyncio.create_task(collect(slog, sid, 0))
    await asyncio.sleep(0.1)
    reads = slog.tailer.catch_up_reads
    for seq in range(1, 201):
        write_tokens(wlog, sid, seq, [f"<{seq}>"])
        await asyncio.sleep(0)
    write_done(wlog, sid, 201)
    events = await asyncio.wait_for(tail, 5)
    assert [e.seq for e in events] == list(range(1, 202))
    assert all(e.text == f"<{e.seq}>" for e in events[:-1])
    # 201 appends, served from the feed: at most a couple of catch-up reads (none needed)
    assert slog.tailer.catch_up_reads - reads <= 2
    assert slog.tailer.feed.messages >= 201


async def test_one_message_per_flush_carries_every_stream(
    slog: StreamStore, wlog: WorkerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(livefeed, "SHED_PAUSE", 0.2)
    sids = [(await start_stream(slog, wlog))[0] for _ in range(300)]  # > one APPEND_CHUNK
    subs = [slog.tailer.subscribe(sid, 0) for sid in sids]  # (no 300 concurrent replays)
    try:
        await asyncio.sleep(0.3)
        # (the blocking calls above may have held the loop long enough to drop the feed)
        await feed_up(slog)
        await asyncio.sleep(0.3)
        before = slog.tailer.feed.messages

        def write_all() -> None:  # in a thread: the event loop stays free meanwhile
            for seq in range(1, 4):
                batches = [Batch(sid, seq, [token_fields(f"{sid}:{seq}")]) for sid in sids]
                assert [r.status for r in wlog.flush(batches)] == [1] * len(sids)
            for sid in sids:
                write_done(wlog, sid, 4)

        await asyncio.get_running_loop().run_in_executor(None, write_all)
        for sid, sub in zip(sids, subs, strict=True):
            got: list[Event] = []
            while len(got) < 4:
                got += await asyncio.wait_for(sub.get(), 10)
            assert [e.text for e in got[:3]] == [f"{sid}:{s}" for s in (1, 2, 3)]
            assert got[3].kind == "done"
        chunks = -(-len(sids) // APPEND_CHUNK)
        assert slog.tailer.feed.messages - before == 3 * chunks + len(sids)
    finally:
        for sub in subs:
            slog.tailer.unsubscribe(sub)


async def test_lost_feed_connection_loses_nothing(slog: StreamStore, wlog: WorkerStore) -> None:
    """The feed's connection is killed again and again while a writer appends."""
    await feed_up(slog)
    sid, _ = await start_stream(slog, wlog)
    total = 1500
    stop = threading.Event()

    def writer() -> None:
        for first in range(1, total, 5):
            write_tokens(wlog, sid, first, [f"<{s}>" for s in range(first, first + 5)])
            time.sleep(0.001)
        write_done(wlog, sid, total + 1)

    async def killer() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.05)
            await slog.redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")

    thread = threading.Thread(target=writer)
    tail = asyncio.create_task(collect(slog, sid, 0))
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
    await feed_up(slog)  # and it comes back


async def test_undecodable_messages_fall_back_to_the_log(
    slog: StreamStore, wlog: WorkerStore
) -> None:
    await feed_up(slog)
    sid, _ = await start_stream(slog, wlog)
    tail = asyncio.create_task(collect(slog, sid, 0))
    await asyncio.sleep(0.1)
    junk = [
        b"not json",
        b"[1, 2]",
        json.dumps([1, [[sid, 1, "x"]]]).encode(),
        json.dumps([1, [[sid, 1, [["k", "t", "x"]]]]]).encode(),  # odd field list
        b"\xff\xfe",
    ]
    for message in junk:
        await slog.redis.publish(slog.keys.events, message)
    await asyncio.sleep(0.1)
    write_tokens(wlog, sid, 1, ["a", "b"])
    write_done(wlog, sid, 3)
    events = await asyncio.wait_for(tail, 5)
    assert [(e.seq, e.text) for e in events] == [(1, "a"), (2, "b"), (3, "")]
    assert slog.tailer.feed.up


async def test_a_feed_far_behind_is_dropped_for_a_while(
    slog: StreamStore, wlog: WorkerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway that cannot keep up reads the logs in batches instead; nothing is lost."""
    await feed_up(slog)
    monkeypatch.setattr(livefeed, "SHED_LAG", 0.5)
    monkeypatch.setattr(livefeed, "SHED_PAUSE", 0.3)
    sid, _ = await start_stream(slog, wlog)
    tail = asyncio.create_task(collect(slog, sid, 0))
    await asyncio.sleep(0.1)
    write_tokens(wlog, sid, 1, ["a"])
    await asyncio.sleep(0.1)
    # a message that Redis sent 5 s ago (as if it had waited in the feed all that time)
    other = new_stream_id()
    late = json.dumps([int(time.time() * 1000) - 5000, [[other, 1, [["k", "t", "x", "z"]]]]])
    await slog.redis.publish(slog.keys.events, late)
    write_tokens(wlog, sid, 2, ["b", "c"])
    write_done(wlog, sid, 4)
    events = await asyncio.wait_for(tail, 5)
    assert [(e.seq, e.text) for e in events] == [(1, "a"), (2, "b"), (3, "c"), (4, "")]
    assert slog.tailer.feed.sheds == 1
    await feed_up(slog)  # and it comes back


async def test_slow_subscriber_overflow_is_read_from_the_log(
    slog: StreamStore, wlog: WorkerStore
) -> None:
    await feed_up(slog)
    sid, _ = await start_stream(slog, wlog)
    sub = slog.tailer.subscribe(sid, 0)
    try:
        await asyncio.sleep(0.1)
        assert not sub.lagging
        total = (2 * BUFFER_LIMIT // 50 + 2) * 50  # twice what the buffer holds, and more
        for first in range(1, total, 50):
            write_tokens(wlog, sid, first, ["x"] * 50)
        await asyncio.sleep(0.2)
        assert len(sub.buffer) == BUFFER_LIMIT and sub.lagging
        got: list[int] = []
        while len(got) < total:
            got += [e.seq for e in await asyncio.wait_for(sub.get(), 2)]
        assert got == list(range(1, total + 1))
    finally:
        slog.tailer.unsubscribe(sub)
