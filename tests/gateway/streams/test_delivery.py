"""The gateway's delivery latency (live events only) and the trace context a stream carries
to its worker and its resumes, against a real redis-server (an in-memory span exporter)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.core.test_tracing import VALID, memory_tracing
from tests.gateway.streams.test_store import collect, start_stream, write_done, write_tokens
from tokenrelay.core.tracing import ClientTrace, parse_traceparent
from tokenrelay.core.wire.telemetry import TRACE_FIELD
from tokenrelay.gateway.streams.store import StreamStore
from tokenrelay.worker.store import WorkerStore


async def until(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def caught_up(stream_store: StreamStore, sid: str) -> bool:
    subs = stream_store.tailer._subs.get(sid, set())
    return stream_store.tailer.feed.up and bool(subs) and not any(s.lagging for s in subs)


async def test_live_events_count_as_deliveries_replays_do_not(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    sid, _ = await start_stream(stream_store, worker_store)
    write_tokens(worker_store, sid, 1, ["a", "b"])
    events = stream_store.tail(sid, -1)
    assert [(await anext(events)).seq for _ in range(3)] == [0, 1, 2]  # the replay
    reading = asyncio.ensure_future(anext(events))  # subscribes, then waits for the feed
    await until(lambda: caught_up(stream_store, sid))
    assert stream_store.delivery.count == 0
    write_tokens(worker_store, sid, 3, ["c"])
    assert (await reading).seq == 3
    write_tokens(worker_store, sid, 4, ["d", "e"])  # one batch: one observation
    assert [(await anext(events)).seq for _ in range(2)] == [4, 5]
    write_done(worker_store, sid, 6)
    assert (await anext(events)).kind == "done"
    await events.aclose()
    assert stream_store.delivery.count == 2
    assert stream_store.delivery.counts[-1] == 0  # none above the last bucket
    # a resume replays from the log: no delivery counted
    assert [e.seq for e in await collect(stream_store, sid, 2)] == [3, 4, 5, 6]
    assert stream_store.delivery.count == 2


async def test_the_trace_goes_with_the_request_and_resumes(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    pytest.importorskip("opentelemetry.sdk")
    tracing, exporter = memory_tracing("tokenrelay-gateway")
    stream_store.tracing = tracing
    stream_store.client_trace = ClientTrace.FOLLOW  # (link, ignore: test_client_traceparent.py)
    new = await stream_store.create({"prompt": "hi", "params": {}}, "r1", traceparent=VALID)
    (req,) = worker_store.read_requests(10, None)
    spans = {s.name: s for s in exporter.get_finished_spans()}  # type: ignore[attr-defined]
    receive, enqueue = spans["gateway.receive"], spans["gateway.enqueue"]
    client = parse_traceparent(VALID)
    assert client is not None
    assert f"{receive.context.trace_id:032x}" == client.trace_id
    assert f"{receive.parent.span_id:016x}" == client.span_id
    assert enqueue.parent.span_id == receive.context.span_id
    assert receive.attributes["tokenrelay.stream_id"] == new.stream_id
    worker_parent = parse_traceparent(req.traceparent)  # the request entry's field
    assert worker_parent is not None and int(worker_parent.span_id, 16) == enqueue.context.span_id
    meta = await stream_store.redis.hget(stream_store.keys.meta(new.stream_id), TRACE_FIELD)
    assert isinstance(meta, bytes) and parse_traceparent(meta.decode()) is not None
    # each attachment is one span under the stream's receive span: a tail, a resume
    exporter.clear()  # type: ignore[attr-defined]
    sid, _ = await start_stream(stream_store, worker_store)
    write_tokens(worker_store, sid, 1, ["a"])
    write_done(worker_store, sid, 2)
    assert [e.seq for e in await collect(stream_store, sid, -1)] == [0, 1, 2]
    assert [e.seq async for e in stream_store.tail(sid, 0, resumed=True)] == [1, 2]
    spans = {s.name: s for s in exporter.get_finished_spans()}  # type: ignore[attr-defined]
    receive = spans["gateway.receive"]
    for name in ("gateway.deliver", "gateway.resume"):
        span = spans[name]
        assert span.context.trace_id == receive.context.trace_id, name
        assert span.parent.span_id == receive.context.span_id, name
        assert span.attributes["tokenrelay.last_seq"] == 2
    assert spans["gateway.resume"].attributes["tokenrelay.events"] == 2
    # a malformed traceparent: a new trace at the gateway, no error
    exporter.clear()  # type: ignore[attr-defined]
    await stream_store.create({"prompt": "hi", "params": {}}, "r2", traceparent="00-zz-01")
    spans = {s.name: s for s in exporter.get_finished_spans()}  # type: ignore[attr-defined]
    assert spans["gateway.receive"].parent is None
