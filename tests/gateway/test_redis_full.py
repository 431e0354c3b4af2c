"""A full Redis (maxmemory, noeviction): clear refusals, nothing lost, reads go on.

This module has its own redis-server with a small ``maxmemory`` and a real gateway
process. The engine worker is its Redis side (worker/store.py, worker/outbox.py)
driven by the test, with no engine: it admits requests and appends events as a
worker does, while a thread beats its heartbeat. tests/worker/test_redis_full.py runs
the real worker loop against a full Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis

from tests.core.redis.test_connection import fill, make_room
from tests.gateway.http.helpers import chat_body, read_sse
from tests.gateway.procs import Client, Proc, generate_frame, start_gateway, stop_all, wait_ready
from tokenrelay.core.redis.connection import is_full, is_outage
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.errors import STORE_FULL
from tokenrelay.core.wire.events import accepted_fields, done_fields, token_fields
from tokenrelay.core.wire.keys import HEARTBEAT_TTL
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.gateway.errors import RedisFull, refusal
from tokenrelay.gateway.streams.memory import MemoryGauge
from tokenrelay.gateway.streams.store import StreamStore
from tokenrelay.worker.outbox import Active, Outbox
from tokenrelay.worker.store import WorkerStore

PREFIX = "full:"
WORKER = "full-worker"


class Beat(threading.Thread):
    """A worker's heartbeat (its own connection, as in worker/heartbeat.py), every 0.5 s."""

    def __init__(self, url: str) -> None:
        super().__init__(name="test-heartbeat", daemon=True)
        self.store = WorkerStore(url, WORKER, prefix=PREFIX)
        self.stop = threading.Event()
        self.refused = 0  # beats a full Redis refused

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.store.heartbeat(WorkerStats(worker_id=WORKER))
            except redis.RedisError as exc:
                assert is_full(exc), exc
                self.refused += 1
            self.stop.wait(0.5)


class Producer:
    """What an engine worker does in Redis, step by step: admit, append, finish."""

    def __init__(self, url: str) -> None:
        self.store = WorkerStore(url, WORKER, prefix=PREFIX)
        self.store.ensure_group()
        self.outbox = Outbox(self.store, lambda sid: None)

    def admit(self) -> Active:
        reqs = self.store.read_requests(1, 5000)
        assert reqs, "no request arrived"
        req = reqs[0]
        a = Active(req.stream_id, req.request_id, req.entry_id, 30.0, 60.0)
        a.events.append(accepted_fields(3, WORKER))
        a.meta.update({"st": "running", "w": WORKER, "pt": "3"})
        self.outbox.streams[a.stream_id] = a
        self.outbox.flush()
        return a

    def add(self, a: Active, *texts: str, final: bool = False) -> None:
        a.events += [token_fields(t) for t in texts]
        if final:
            a.events.append(done_fields("length", 3, a.completion_events))
            a.final = True

    async def flush_when_room(self, timeout: float = 5.0) -> None:
        """Flush as the worker's loop does: again and again while Redis is out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                self.outbox.flush()
                return
            except redis.RedisError as exc:
                assert is_outage(exc) and loop.time() < deadline, exc
                await asyncio.sleep(0.1)


async def _unguarded(aw: Awaitable[Any]) -> Any:
    return await aw


@dataclass
class Full:
    server: EmbeddedRedis
    client: redis.Redis
    gateway: Proc
    addr: str
    worker: Producer
    beat: Beat


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Full]:
    logs = tmp_path_factory.mktemp("full-logs")
    server = EmbeddedRedis(tmp_path_factory.mktemp("full-redis"), maxmemory="8mb").start()
    beat = Beat(server.url)
    beat.start()
    worker = Producer(server.url)
    gateway, addr = start_gateway(server.url, PREFIX, logs)
    try:
        wait_ready(addr, gateway, 60)
        yield Full(server, server.client(), gateway, addr, worker, beat)
    finally:
        beat.stop.set()
        stop_all([gateway])
        server.cleanup()


async def _generate(c: Client, rid: str) -> dict[str, Any] | None:
    """Send a generate; its error frame, or None when it was queued (no answer yet)."""
    await c.send(generate_frame("Hello", rid, max_tokens=8))
    with contextlib.suppress(TimeoutError):
        return await c.recv(0.5)
    return None


def _chat(addr: str, rid: str) -> httpx.Response:
    body = chat_body("Hello", max_tokens=8, stream=True)
    return httpx.post(
        f"http://{addr}/v1/chat/completions", json=body, headers={"X-Request-Id": rid}, timeout=30
    )


def _sse_resume(addr: str, sid: str, token: str) -> list[int]:
    url = f"http://{addr}/v1/streams/{sid}/events"
    params = {"after": "0"}
    headers = {"X-Resume-Token": token}
    with httpx.stream("GET", url, params=params, headers=headers, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        return read_sse(resp, limit=2).ids


async def test_a_full_redis_refuses_new_streams_and_keeps_the_running_one(full: Full) -> None:
    worker = full.worker
    live = await Client.open(full.addr)
    late = await Client.open(full.addr)
    try:
        await live.send(generate_frame("Tell me a story.", "live", max_tokens=50))
        a = await asyncio.to_thread(worker.admit)
        started = (await live.recv_until(lambda f: f["type"] == "started", 10))[-1]
        sid, token = started["stream_id"], started["resume_token"]
        worker.add(a, "Once", " upon")
        worker.outbox.flush()
        assert [f["seq"] for f in await live.recv_until(lambda f: f.get("seq") == 2)] == [1, 2]

        limit = fill(full.client)
        # a new stream: `overloaded` with a retry hint, over the WebSocket and HTTP
        refused = await _generate(late, "late")
        assert refused is not None and refused["type"] == "error", refused
        assert refused["code"] == "overloaded" and refused["message"] == STORE_FULL
        assert refused["request_id"] == "late" and refused["retry_after"] == 5
        await late.send({"type": "ping"})
        assert (await late.recv(5))["type"] == "pong"  # the socket stays usable
        resp = await asyncio.to_thread(_chat, full.addr, "late-http")
        assert resp.status_code == 503, resp.text
        assert resp.headers["Retry-After"] == "5" and resp.headers["X-Request-Id"] == "late-http"
        assert resp.json()["error"] == {
            "message": STORE_FULL, "type": "server_error", "param": None, "code": "overloaded"
        }  # fmt: skip

        # the worker's appends are refused, and kept
        worker.add(a, " a", " time")
        with pytest.raises(redis.RedisError) as appended:
            worker.outbox.flush()
        assert is_full(appended.value) and is_outage(appended.value)
        assert a.written == 3 and len(a.events) == 5
        # its heartbeat still keeps it alive (PEXPIRE takes no memory)
        key = f"{PREFIX}w:{WORKER}"
        full.client.pexpire(key, 800)  # would lapse before long but for the beats
        await asyncio.sleep(0.6)  # a beat or two, refused
        assert full.beat.refused > 0 and full.client.pttl(key) > (HEARTBEAT_TTL - 1) * 1000

        # reads go on: resume over the WebSocket and over SSE
        again = await Client.open(full.addr)
        try:
            await again.send({"type": "resume", "stream_id": sid, "resume_token": token,
                              "after": 1})  # fmt: skip
            frames = await again.recv_until(lambda f: f.get("seq") == 2, 10)
            assert [f["type"] for f in frames] == ["resumed", "token"], frames
            assert await asyncio.to_thread(_sse_resume, full.addr, sid, token) == [1, 2]
            assert httpx.get(f"http://{full.addr}/healthz", timeout=5).status_code == 200

            # room again: the kept events land, in order, and the stream ends
            make_room(full.client, limit)
            await worker.flush_when_room()
            worker.add(a, final=True)
            worker.outbox.flush()
            for client, after in ((live, 2), (again, 2)):
                frames = await client.recv_until(lambda f: f["type"] == "done", 10)
                assert [f["seq"] for f in frames] == list(range(after + 1, 6)), frames
                assert "".join(f.get("text", "") for f in frames) == " a time"
        finally:
            await again.close()

        # new streams are taken again (the gateway looks at Redis' memory once a second)
        for _ in range(20):
            refused = await _generate(late, "after")
            if refused is None:
                break
            assert refused["code"] == "overloaded", refused
            await asyncio.sleep(0.25)
        assert refused is None, "still refused once Redis had room"
        b = await asyncio.to_thread(worker.admit)
        assert (await late.recv(10))["type"] == "started"
        worker.add(b, "Hi", final=True)
        worker.outbox.flush()
        assert (await late.recv_until(lambda f: f["type"] == "done", 10))[-1]["seq"] == 2
    finally:
        await live.close()
        await late.close()
    log = full.gateway.log_text()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert "Traceback" not in log and not [r for r in lines if r["level"] == "error"], log
    refusals = [r for r in lines if r.get("request_id") in ("late", "late-http")]
    assert [r["msg"] for r in refusals] == ["frame refused", "request refused"], refusals


async def test_a_write_refused_at_maxmemory_is_overloaded(
    full: Full, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis' own refusal (OOM) is ``overloaded``, and so is the gateway's earlier one, at
    90% of maxmemory, which keeps the last tenth for the streams already running."""
    url = full.server.url
    gauge_off = StreamStore(url, prefix=PREFIX, admit_memory=None)
    store = StreamStore(url, prefix=PREFIX)
    gauge = MemoryGauge(store.redis, _unguarded, max_age=0)
    for s in (gauge_off, store):
        await s.start()
    limit = fill(full.client)
    try:
        for s in (gauge_off, store):
            with pytest.raises(RedisFull) as exc:
                await s.create({"prompt": "Hi"}, "oom")
            r = refusal(exc.value)
            assert (r.code, r.message, r.retry_after) == ("overloaded", STORE_FULL, 5)
        # a resume's attachment waits for room instead of failing the resume
        assert await store.attach("some-stream") in store.attachments.tracked
        # under the limit but over 90% of it: refused by the gateway, writes still taken
        make_room(full.client, limit)
        used = int(full.client.info("memory")["used_memory"])
        full.client.config_set("maxmemory", int(used / 0.95))
        caplog.clear()
        with caplog.at_level(logging.WARNING, "tokenrelay.gateway"):
            assert await gauge.full()
            assert full.client.set("still-writable", "1")
            full.client.delete("still-writable")
            full.client.config_set("maxmemory", limit)
            assert not await gauge.full()
        said = [r.getMessage() for r in caplog.records if r.name == "tokenrelay.gateway"]
        assert said == ["redis is nearly full: new streams are refused",
                        "redis has room again: new streams are taken"]  # fmt: skip
    finally:
        make_room(full.client, limit)
        await gauge_off.close()
        await store.close()
