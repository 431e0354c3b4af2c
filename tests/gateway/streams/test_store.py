"""The Redis stream log against a real redis-server: offsets, replay + tail, races, expiry.

The writer side is the real :class:`WorkerStore` (what engine workers use); the
reader side is the real :class:`StreamStore` (what gateways use).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import pytest
import redis

from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.events import (
    Event,
    accepted_fields,
    decode_ids,
    done_fields,
    entry_id,
    token_fields,
)
from tokenrelay.core.wire.ids import new_stream_id
from tokenrelay.core.wire.keys import GROUP
from tokenrelay.core.wire.scripts import OWNED_ELSEWHERE, decode_published
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.gateway.errors import (
    BadOffset,
    EventsTrimmed,
    StreamForbidden,
    StreamNotFound,
)
from tokenrelay.gateway.streams import tailer as tailer_module
from tokenrelay.gateway.streams.store import StreamStore
from tokenrelay.gateway.streams.tailer import BUFFER_LIMIT, Subscription
from tokenrelay.worker.continuation import finish_foreign, read_log, take_over
from tokenrelay.worker.store import CLAIM_MIN_IDLE, Batch, WorkerStore

BODY = {"prompt": "hi", "params": {"max_tokens": 4}}
ENTRIES: dict[str, str] = {}  # stream id -> its request entry (acknowledged with done)


async def start_stream(
    stream_store: StreamStore, worker_store: WorkerStore, ttl: float = 60.0
) -> tuple[str, str]:
    """A stream taken by the worker (accepted marker written); returns (id, token)."""
    new = await stream_store.create(BODY, "r1")
    reqs = worker_store.read_requests(10, None)
    assert [r.stream_id for r in reqs] == [new.stream_id]
    ENTRIES[new.stream_id] = reqs[0].entry_id
    res = worker_store.flush(
        [
            Batch(
                new.stream_id,
                0,
                [accepted_fields(3, "w-test")],
                {"st": "running", "w": "w-test", "pt": "3"},
                ttl,
            )
        ]
    )
    assert res[0].status == 1
    return new.stream_id, new.resume_token


def write_tokens(
    worker_store: WorkerStore, sid: str, first: int, texts: list[str], ttl: float = 60.0
) -> None:
    res = worker_store.flush([Batch(sid, first, [token_fields(t) for t in texts], {}, ttl)])
    assert res[0].status == 1, res


def write_done(worker_store: WorkerStore, sid: str, seq: int, ttl: float = 60.0) -> None:
    done = done_fields("stop", 3, seq - 1)
    res = worker_store.flush([Batch(sid, seq, [done], {"fr": "stop"}, ttl, ENTRIES.get(sid))])
    assert res[0].status == 1, res


async def collect(stream_store: StreamStore, sid: str, after: int) -> list[Event]:
    return [ev async for ev in stream_store.tail(sid, after)]


async def test_lifecycle_and_offsets(stream_store: StreamStore, worker_store: WorkerStore) -> None:
    sid, token = await start_stream(stream_store, worker_store)
    info = await stream_store.authorize(sid, token)
    assert info.status == "running" and info.worker == "w-test" and info.prompt_tokens == 3
    write_tokens(worker_store, sid, 1, ["Hel", "lo", " world"])
    write_done(worker_store, sid, 4)
    events = await collect(stream_store, sid, -1)
    assert [e.seq for e in events] == [0, 1, 2, 3, 4]
    assert events[0].kind == "accepted" and events[0].prompt_tokens == 3
    assert "".join(e.text for e in events if e.kind == "token") == "Hello world"
    assert events[-1].kind == "done" and events[-1].finish_reason == "stop"
    assert [e.seq for e in await collect(stream_store, sid, 2)] == [3, 4]
    assert [e.seq for e in await collect(stream_store, sid, 3)] == [4]
    final = await stream_store.info(sid)
    assert final is not None and final.status == "done" and final.last_seq == 4
    assert final.finish_reason == "stop"
    # the finished request left the request stream
    assert await stream_store.redis.xlen(stream_store.keys.requests) == 0
    assert 0 < await stream_store.redis.ttl(stream_store.keys.stream(sid)) <= 60


async def test_tokens_are_checked_and_stored_hashed(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    sid, token = await start_stream(stream_store, worker_store)
    with pytest.raises(StreamForbidden):
        await stream_store.authorize(sid, token + "x")
    with pytest.raises(StreamForbidden):
        await stream_store.authorize(sid, "")
    raw = await stream_store.redis.hgetall(stream_store.keys.meta(sid))
    assert token.encode() not in b"".join(bytes(v) for v in raw.values())  # type: ignore[arg-type]
    with pytest.raises(StreamNotFound):
        await stream_store.authorize(new_stream_id(), token)


async def test_after_beyond_the_end_is_refused(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    sid, _ = await start_stream(stream_store, worker_store)
    write_tokens(worker_store, sid, 1, ["a", "b"])
    await stream_store.check_after(sid, 2)
    with pytest.raises(BadOffset):
        await stream_store.check_after(sid, 3)


async def test_writes_are_gapless_and_never_duplicated(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    sid, _ = await start_stream(stream_store, worker_store)
    write_tokens(worker_store, sid, 1, ["a"])
    again = worker_store.flush([Batch(sid, 1, [token_fields("a")])])[0]
    assert again.status == 0 and again.last_seq == 1 and again.top is not None
    assert again.top.text == "a"
    gap = worker_store.flush([Batch(sid, 5, [token_fields("e")])])[0]
    assert gap.status == 0 and gap.last_seq == 1
    write_done(worker_store, sid, 2)
    late = worker_store.flush([Batch(sid, 3, [token_fields("late")])])[0]
    assert late.status == -2
    unknown = worker_store.flush([Batch(new_stream_id(), 0, [token_fields("x")])])[0]
    assert unknown.status == -1


async def test_replay_then_tail_has_no_gap_and_no_duplicate(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    """Readers join at random offsets and times while a writer appends in batches."""
    sid, _ = await start_stream(stream_store, worker_store)
    total = 600
    rng = random.Random(7)

    def writer() -> None:
        seq = 1
        while seq < total:
            n = min(rng.randint(1, 9), total - seq)
            write_tokens(worker_store, sid, seq, [f"<{s}>" for s in range(seq, seq + n)])
            seq += n
            time.sleep(rng.random() * 0.004)
        write_done(worker_store, sid, total)

    async def reader(after: int, delay: float) -> None:
        await asyncio.sleep(delay)
        events = await collect(stream_store, sid, after)
        assert [e.seq for e in events] == list(range(after + 1, total + 1))
        assert all(e.text == f"<{e.seq}>" for e in events if e.kind == "token")

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        await asyncio.gather(
            *(reader(rng.randint(0, total - 1), rng.random() * 0.8) for _ in range(25))
        )
    finally:
        thread.join()


async def test_resume_racing_the_end_of_the_stream(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    for _ in range(20):
        sid, _ = await start_stream(stream_store, worker_store)
        write_tokens(worker_store, sid, 1, ["x", "y"])
        finisher = asyncio.get_running_loop().run_in_executor(
            None, write_done, worker_store, sid, 3
        )
        events = await asyncio.wait_for(collect(stream_store, sid, 2), 5)
        await finisher
        assert [e.seq for e in events] == [3] and events[0].kind == "done"


async def test_unknown_and_expired_streams(
    redis_server: EmbeddedRedis, prefix: str, worker_store: WorkerStore
) -> None:
    stream_store = StreamStore(redis_server.url, prefix=prefix, stream_ttl=1)
    await stream_store.start()
    try:
        assert await stream_store.info(new_stream_id()) is None
        sid, token = await start_stream(stream_store, worker_store, ttl=1)
        write_done(worker_store, sid, 1, ttl=1)
        assert [e.kind for e in await collect(stream_store, sid, 0)] == ["done"]
        await asyncio.sleep(2.2)
        with pytest.raises(StreamNotFound):
            await stream_store.authorize(sid, token)
        # a tail that was waiting when the stream expired ends with not_found, not a hang
        sid2, _ = await start_stream(stream_store, worker_store)
        tail = asyncio.create_task(collect(stream_store, sid2, 0))
        await asyncio.sleep(0.2)
        await stream_store.redis.delete(
            stream_store.keys.meta(sid2), stream_store.keys.stream(sid2)
        )
        with pytest.raises(StreamNotFound):
            await asyncio.wait_for(tail, 5)
    finally:
        await stream_store.close()


async def test_trimmed_events_are_reported(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    sid, _ = await start_stream(stream_store, worker_store)
    write_tokens(worker_store, sid, 1, ["a", "b", "c"])
    await stream_store.redis.xdel(stream_store.keys.stream(sid), entry_id(1), entry_id(2))
    with pytest.raises(EventsTrimmed):
        await collect(stream_store, sid, 0)


async def test_cancel(stream_store: StreamStore, worker_store: WorkerStore) -> None:
    worker_store.read_control()  # position the cursor
    sid, _ = await start_stream(stream_store, worker_store)
    outcome = await stream_store.request_cancel(sid)
    assert not outcome.already_finished
    assert outcome.info.cancel_requested and outcome.info.status == "running"
    assert worker_store.read_control() == [sid]
    assert worker_store.poll([sid])[sid] == (1, True)
    await stream_store.cancel(sid)  # idempotent
    write_done(worker_store, sid, 1)
    after = await stream_store.request_cancel(sid)
    assert after.already_finished and after.info.finish_reason == "stop"
    # a stream no worker has taken yet is ended by the gateway at once
    queued = await stream_store.create(BODY, "r2")
    ended = await stream_store.cancel(queued.stream_id)
    assert ended.status == "done" and ended.finish_reason == "cancelled"
    events = await collect(stream_store, queued.stream_id, -1)
    assert [(e.seq, e.kind) for e in events] == [(0, "rejected"), (1, "done")]
    assert events[1].finish_reason == "cancelled"
    with pytest.raises(StreamNotFound):
        await stream_store.cancel(new_stream_id())


async def test_read_new_brings_the_cancel_notices_along(
    stream_store: StreamStore, worker_store: WorkerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy worker's read: requests and cancel notices in one round trip."""
    assert worker_store.read_new(10) == []  # the first read positions the control cursor
    assert worker_store.read_control() == []
    sid, _ = await start_stream(stream_store, worker_store)
    await stream_store.request_cancel(sid)
    queued = await stream_store.create(BODY, "r2")
    reqs = worker_store.read_new(10)
    assert [(r.stream_id, r.request_id) for r in reqs] == [(queued.stream_id, "r2")]
    assert reqs[0].body == BODY and reqs[0].meta is not None
    await stream_store.request_cancel(queued.stream_id)
    assert worker_store.read_new(10) == []  # notices add up until read_control() takes them
    with monkeypatch.context() as m:  # they are here already: no command
        m.setattr(worker_store, "_control_read", None)
        assert worker_store.read_control() == [sid, queued.stream_id]
    assert worker_store.read_control() == []
    # a control read that fails in the pipeline is read again by read_control()
    worker_store.redis.set(worker_store.keys.control, "not a stream")
    other = await stream_store.create(BODY, "r3")
    assert [r.stream_id for r in worker_store.read_new(10)] == [other.stream_id]
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        worker_store.read_control()


async def test_attachments(stream_store: StreamStore, worker_store: WorkerStore) -> None:
    sid, _ = await start_stream(stream_store, worker_store)
    assert worker_store.poll([sid])[sid][0] == 1  # the creating client is attached
    extra = await stream_store.attach(sid)
    assert worker_store.poll([sid])[sid][0] == 2
    await stream_store.detach(sid, extra)
    for attach_id in [a for a, s in stream_store.attachments.tracked.items() if s == sid]:
        await stream_store.detach(sid, attach_id)
    assert worker_store.poll([sid])[sid][0] == 0


async def test_a_burst_of_detaches_is_a_few_script_calls(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    sids = [(await start_stream(stream_store, worker_store))[0] for _ in range(6)]
    write_done(worker_store, sids[0], 1)  # leaving a finished stream is no disconnect
    extra = {sid: [await stream_store.attach(sid) for _ in range(50)] for sid in sids}  # 300 in all
    calls, before = stream_store.attachments.detach_calls, stream_store.disconnects
    await asyncio.gather(
        *(stream_store.detach(sid, aid) for sid, ids in extra.items() for aid in ids)
    )
    assert stream_store.attachments.detach_calls - calls <= 2  # 300 detaches, chunks of 250
    assert stream_store.disconnects - before == 250  # the five unfinished streams, 50 each
    assert [worker_store.poll([sid])[sid][0] for sid in sids] == [
        1
    ] * 6  # the creators stay attached
    metas = [await stream_store.redis.hgetall(stream_store.keys.meta(sid)) for sid in sids]
    assert [int(m.get(b"dc", 0)) for m in metas] == [0] + [50] * 5


async def test_detaches_without_redis_answer_false_and_never_hang(tmp_path: Path) -> None:
    down = StreamStore(f"unix://{tmp_path}/no-redis.sock", prefix="x:", stream_ttl=60)
    try:
        detaches = (down.attachments.detach(new_stream_id(), f"a{i}") for i in range(5))
        got = await asyncio.wait_for(asyncio.gather(*detaches), 20)
        assert got == [False] * 5
    finally:
        await down.attachments.close()
        await down.redis.aclose()


async def test_gateway_finish_races_the_worker(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    sid, _ = await start_stream(stream_store, worker_store)
    write_tokens(worker_store, sid, 1, ["a"])
    assert await stream_store.finish(sid, "error", "worker died")
    late = worker_store.flush([Batch(sid, 2, [token_fields("b")])])[0]
    assert late.status == -2 and late.top is not None and late.top.kind == "done"
    assert not await stream_store.finish(sid, "error", "again")
    events = await collect(stream_store, sid, 0)
    assert [(e.seq, e.kind) for e in events] == [(1, "token"), (2, "done")]
    assert events[-1].message == "worker died" and events[-1].completion_tokens == 1


async def test_dead_workers_stream_is_left_to_workers_then_ended_as_a_backstop(
    stream_store: StreamStore, worker_store: WorkerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A running stream whose worker is gone is for a live worker to continue: the tailer
    waits, and ends it (naming the worker) only once nobody did within its deadline."""
    monkeypatch.setattr(tailer_module, "CONTINUE_DEADLINE", 3.0)
    sid, _ = await start_stream(stream_store, worker_store)
    write_tokens(worker_store, sid, 1, ["a"])
    tail = asyncio.create_task(collect(stream_store, sid, 0))
    await stream_store.redis.delete(
        stream_store.keys.worker("w-test")
    )  # heartbeat gone, as after SIGKILL
    await asyncio.sleep(2.0)
    assert not tail.done()  # still open: a worker may continue it
    events = await asyncio.wait_for(tail, 10)
    assert events[-1].kind == "done" and events[-1].finish_reason == "error"
    assert "w-test" in (events[-1].message or "") and "continued" in (events[-1].message or "")


async def test_slow_subscriber_is_bounded_and_does_not_stall_others(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    slow_sid, _ = await start_stream(stream_store, worker_store)
    fast_sid, _ = await start_stream(stream_store, worker_store)
    slow = stream_store.tailer.subscribe(slow_sid, 0)
    try:
        write_tokens(worker_store, slow_sid, 1, ["s"] * 1500)
        await asyncio.sleep(0.3)
        assert len(slow.buffer) <= BUFFER_LIMIT
        fast = asyncio.create_task(collect(stream_store, fast_sid, 0))
        await asyncio.sleep(0.05)
        write_tokens(worker_store, fast_sid, 1, ["f"] * 10)
        write_done(worker_store, fast_sid, 11)
        events = await asyncio.wait_for(fast, 2)
        assert len(events) == 11
        got: list[int] = []
        while len(got) < 1500:
            got += [e.seq for e in await asyncio.wait_for(slow.get(), 2)]
            assert len(slow.buffer) <= BUFFER_LIMIT
        assert got == list(range(1, 1501))
    finally:
        stream_store.tailer.unsubscribe(slow)


async def test_subscribers_joining_behind_a_live_reader_see_no_gap(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    """A reply read for a reader further ahead must not reach one that joined behind it."""
    sid, _ = await start_stream(stream_store, worker_store)
    total = 3000
    lead = stream_store.tailer.subscribe(sid, 0)

    def writer() -> None:
        for first in range(1, total + 1, 3):
            write_tokens(worker_store, sid, first, ["x"] * min(3, total + 1 - first))
            time.sleep(0.0005)

    async def follow(sub: Subscription, after: int) -> None:
        got: list[int] = []
        try:
            while not got or got[-1] < total:
                got += [e.seq for e in await asyncio.wait_for(sub.get(), 5)]
        finally:
            stream_store.tailer.unsubscribe(sub)
        assert got == list(range(after + 1, total + 1))

    async def join_late() -> None:
        rng = random.Random(3)
        for _ in range(60):
            await asyncio.sleep(rng.random() * 0.02)
            behind = max(0, lead.last_seq - rng.randint(1, 40))
            joined.append(
                asyncio.create_task(follow(stream_store.tailer.subscribe(sid, behind), behind))
            )

    joined: list[asyncio.Task[None]] = []
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        await asyncio.gather(follow(lead, 0), join_late())
        await asyncio.gather(*joined)
    finally:
        thread.join()


async def test_redis_outage_and_recovery(tmp_path, prefix: str) -> None:  # type: ignore[no-untyped-def]
    server = EmbeddedRedis(tmp_path / "r").start()
    stream_store = StreamStore(server.url, prefix=prefix)
    await stream_store.start()
    worker_store = WorkerStore(server.url, "w-test", prefix=prefix)
    try:
        worker_store.ensure_group()
        worker_store.heartbeat(WorkerStats())
        sid, _ = await start_stream(stream_store, worker_store)
        tail = asyncio.create_task(collect(stream_store, sid, 0))
        await asyncio.sleep(0.2)
        server.stop()
        from tokenrelay.gateway.errors import RedisUnavailable

        with pytest.raises(RedisUnavailable):
            await asyncio.wait_for(tail, 5)
        with pytest.raises(RedisUnavailable):
            await stream_store.info(sid)
        assert not await stream_store.ping()
        server.start()
        assert await stream_store.ping()
        worker_store.heartbeat(WorkerStats())
        write_tokens(worker_store, sid, 1, ["back"])  # the AOF kept the stream
        write_done(worker_store, sid, 2)
        events = await asyncio.wait_for(collect(stream_store, sid, 0), 5)
        assert [e.seq for e in events] == [1, 2]
    finally:
        worker_store.close()
        await stream_store.close()
        server.cleanup()


async def test_requests_of_a_dead_worker_are_claimed(
    redis_server: EmbeddedRedis, prefix: str, stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    """A queued request read by a worker that died goes to another; a running one is ended."""
    queued = await stream_store.create(BODY, "q")
    running = await stream_store.create(BODY, "r")
    taken = worker_store.read_requests(10, None)  # worker "w-test" takes both, then dies
    assert len(taken) == 2
    worker_store.flush(
        [
            Batch(
                running.stream_id,
                0,
                [accepted_fields(3, "w-test")],
                {"st": "running", "w": "w-test", "pt": "3"},
            )
        ]
    )
    heir = WorkerStore(redis_server.url, "w-heir", prefix=prefix)
    try:
        heir.heartbeat(WorkerStats())
        assert heir.claim_dead() == []  # w-test is alive
        await stream_store.redis.delete(stream_store.keys.worker("w-test"))
        assert heir.claim_dead() == []  # not idle long enough yet
        await asyncio.sleep(CLAIM_MIN_IDLE + 0.2)
        claimed = {r.stream_id: r for r in heir.claim_dead()}
        assert set(claimed) == {queued.stream_id, running.stream_id}
        meta = claimed[queued.stream_id].meta
        assert meta is not None and meta["st"] == "queued"
        assert claimed[running.stream_id].body == BODY
        assert await stream_store.redis.sismember(stream_store.keys.workers, "w-test") == 0
        # what a worker does with a claimed stream that was already running
        assert finish_foreign(heir, running.stream_id, "error", "engine worker w-test died")
        assert not finish_foreign(heir, running.stream_id, "error", "twice")
        events = await collect(stream_store, running.stream_id, 0)
        assert [(e.seq, e.kind, e.finish_reason) for e in events] == [(1, "done", "error")]
        pending = await stream_store.redis.xpending(stream_store.keys.requests, GROUP)
        assert pending["pending"] == 2 and pending["consumers"][0]["name"] == b"w-heir"
    finally:
        heir.close()


async def test_a_taken_over_stream_fences_its_old_worker(
    redis_server: EmbeddedRedis, prefix: str, stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    """The takeover names the new owner; the old worker's writes are refused from then on,
    the new owner's land, and the log reads back with its token ids."""
    created = await stream_store.create(BODY, "r")
    sid = created.stream_id
    running = {"st": "running", "w": "w-test", "pt": "3"}
    first = [accepted_fields(3, "w-test"), token_fields("a", None, [5, 6])]
    assert worker_store.flush([Batch(sid, 0, first, running, owner="w-test")])[0].status == 1
    heir = WorkerStore(redis_server.url, "w-heir", prefix=prefix)
    try:
        assert take_over(heir, sid, "w-other") == 0  # not that worker's stream
        assert take_over(heir, sid, "w-test") == 1
        assert take_over(heir, sid, "w-test") == 0  # taken already: one winner
        late = worker_store.flush([Batch(sid, 2, [token_fields("b", None, [7])], owner="w-test")])
        assert late[0].status == OWNED_ELSEWHERE
        log = read_log(heir, sid)
        assert [seq for seq, _ in log] == [0, 1]
        assert decode_ids(dict(zip(log[1][1][0::2], log[1][1][1::2], strict=True))["i"]) == [5, 6]
        ok = heir.flush([Batch(sid, 2, [token_fields("c", None, [8])], owner="w-heir")])
        assert ok[0].status == 1
        assert (await stream_store.redis.hget(stream_store.keys.meta(sid), "to")) == b"1"
    finally:
        heir.close()


async def test_each_request_goes_to_exactly_one_worker(
    redis_server: EmbeddedRedis, prefix: str, stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    other = WorkerStore(redis_server.url, "w-other", prefix=prefix)
    try:
        created = {(await stream_store.create(BODY, f"r{i}")).stream_id for i in range(30)}
        seen: list[str] = []
        loop = asyncio.get_running_loop()
        while len(seen) < 30:
            a, b = await asyncio.gather(
                loop.run_in_executor(None, worker_store.read_requests, 4, 50),
                loop.run_in_executor(None, other.read_requests, 4, 50),
            )
            assert a or b
            seen += [r.stream_id for r in a + b]
        assert sorted(seen) == sorted(created)  # all of them, none twice
    finally:
        other.close()


async def test_script_pipelines_are_one_round_trip_and_survive_a_flushed_cache(
    tmp_path: Path, prefix: str
) -> None:
    """A generate, an engine step's append and a poll send no ``SCRIPT`` command of their
    own (redis-py adds a ``SCRIPT EXISTS`` round trip to pipelines holding registered
    scripts), and still work when Redis lost its script cache (as after a restart)."""
    own = EmbeddedRedis(tmp_path / "redis").start()
    stream_store = StreamStore(own.url, prefix=prefix, stream_ttl=60, detach_timeout=30)
    worker_store = WorkerStore(own.url, "w-test", prefix=prefix)
    try:
        worker_store.ensure_group()
        worker_store.heartbeat(WorkerStats())
        await stream_store.start()
        admin = own.client()
        for flushed in (False, True):
            if flushed:
                admin.script_flush()
            admin.config_resetstat()
            sid, _ = await start_stream(stream_store, worker_store)
            write_tokens(worker_store, sid, 1, ["a", "b"])
            assert worker_store.poll([sid]) == {sid: (1, False)}
            stats = admin.info("commandstats")
            assert "cmdstat_script" not in stats, stats
            assert "cmdstat_evalsha" not in stats, stats
            assert stats["cmdstat_eval"]["calls"] == 4  # attach, accepted, tokens, poll
            assert stats["cmdstat_eval"]["failed_calls"] == 0
            write_done(worker_store, sid, 3)
            assert [e.text for e in await collect(stream_store, sid, 0) if e.kind == "token"] == [
                "a",
                "b",
            ]
    finally:
        await stream_store.close()
        worker_store.close()
        own.stop()


AWKWARD_TEXTS = [
    "héllo",
    "日本語のテキスト",
    "🙂👍🏽",  # astral-plane characters (surrogate pairs in JSON's \u escapes)
    'quote " and backslash \\ and /slash',
    "tab\tnewline\ncarriage\r",
    "nul \x00 bell \x07 del \x7f",
    "\u2028\u2029 line separators",
    "",
    " " * 3,
    "x" * 5000,
    "[1, 2]",  # text that is itself JSON
    "-1",
]


async def test_any_text_and_metadata_round_trip_through_the_append(
    redis_server: EmbeddedRedis, stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    """An append's events and metadata reach the log, the metadata hash and the published
    message exactly as given, whatever their characters (APPEND_LUA takes them as one
    JSON argument that cjson decodes)."""
    sid, _ = await start_stream(stream_store, worker_store)
    other, _ = await start_stream(stream_store, worker_store)
    pubsub = redis_server.client().pubsub()
    pubsub.subscribe(stream_store.keys.events)
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]
    meta = {"x-é": "🙂", "empty": "", "q": '"\\'}
    res = worker_store.flush(
        [
            Batch(sid, 1, [token_fields(t) for t in AWKWARD_TEXTS], meta),
            Batch(other, 1, [], {"only": "meta"}),  # metadata alone: written, nothing published
        ]
    )
    assert [(r.status, r.last_seq) for r in res] == [(1, len(AWKWARD_TEXTS)), (1, 0)]
    stored = await stream_store.redis.hgetall(stream_store.keys.meta(sid))
    for k, v in meta.items():
        assert stored[k.encode()].decode() == v
    assert (await stream_store.redis.hget(stream_store.keys.meta(other), "only")) == b"meta"
    msg = pubsub.get_message(timeout=5)
    assert msg is not None and msg["type"] == "message"
    _, published = decode_published(msg["data"])
    assert [(s, first) for s, first, _ in published] == [(sid, 1)]
    assert [e.text for e in published[0][2]] == AWKWARD_TEXTS
    pubsub.close()
    write_done(worker_store, sid, len(AWKWARD_TEXTS) + 1, ttl=77)  # ends it, with its TTL
    tokens = [e for e in await collect(stream_store, sid, 0) if e.kind == "token"]
    assert [e.text for e in tokens] == AWKWARD_TEXTS
    assert [e.seq for e in tokens] == list(range(1, len(AWKWARD_TEXTS) + 1))
    info = await stream_store.info(sid)
    assert info is not None and info.status == "done" and info.finish_reason == "stop"
    assert 0 < await stream_store.redis.ttl(stream_store.keys.stream(sid)) <= 77


async def test_a_requests_detach_timeout_goes_into_its_record(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    """The request's own detach timeout, else the gateway's (30 s here), is what the worker
    reads from the request record."""
    asked = await stream_store.create(BODY, "long", detach_timeout=300.0)
    plain = await stream_store.create(BODY, "plain")
    reqs = {r.stream_id: r for r in worker_store.read_requests(10, None)}
    assert reqs[asked.stream_id].detach_timeout == 300.0
    assert reqs[plain.stream_id].detach_timeout == stream_store.detach_timeout == 30
    assert reqs[asked.stream_id].body == BODY  # not in the body the engine gets
