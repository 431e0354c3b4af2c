"""Readiness and graceful shutdown with real processes.

This module has its own redis-server (so it can be stopped), a gateway and an
engine worker with a small token budget per step (so a long prompt stays
unstarted for a while).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from tests.gateway.procs import (
    Client,
    Proc,
    generate_frame,
    start_gateway,
    start_worker,
    stop_all,
    wait_ready,
)
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.keys import Keys

PREFIX = "dr:"


@dataclass
class Cluster:
    redis: EmbeddedRedis
    gateway: Proc
    addr: str
    worker: Proc
    logs: Path
    extra: list[Proc] = field(default_factory=list)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("drain-logs")
    redis = EmbeddedRedis(tmp_path_factory.mktemp("drain-redis")).start()
    worker = start_worker(redis.url, PREFIX, logs, "--worker-id", "drain-w1",
                          "--max-num-batched-tokens", "16", "--drain-timeout", "60")  # fmt: skip
    gateway, addr = start_gateway(redis.url, PREFIX, logs)
    c = Cluster(redis, gateway, addr, worker, logs)
    try:
        wait_ready(addr, gateway, 300)
        yield c
    finally:
        stop_all([gateway, *c.extra, worker])
        redis.cleanup()


def readyz(addr: str) -> tuple[int, dict[str, Any]]:
    resp = httpx.get(f"http://{addr}/readyz", timeout=5)
    return resp.status_code, resp.json()


async def wait_exit(proc: Proc, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while proc.alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not proc.alive(), f"still running:\n{proc.log_text()[-2000:]}"
    return int(proc.proc.returncode)


def logged(proc: Proc, msg: str) -> list[dict[str, Any]]:
    lines = [json.loads(ln) for ln in proc.log_text().splitlines() if ln.startswith("{")]
    return [ln for ln in lines if ln.get("msg") == msg]


def test_a_draining_worker_does_not_make_the_gateway_ready(cluster: Cluster) -> None:
    ready = {"ready": True, "redis": True, "workers": 1, "draining": 0}
    assert readyz(cluster.addr) == (200, ready)
    client = cluster.redis.client()
    key = f"{PREFIX}w:drain-w1"
    seen = []
    for _ in range(5):  # the worker republishes its own stats every second: race it
        stats = json.loads(client.hget(key, "stats") or b"{}")
        client.hset(key, "stats", json.dumps({**stats, "draining": True}))
        seen.append(readyz(cluster.addr))
    assert (503, {**ready, "ready": False, "draining": 1}) in seen, seen
    deadline = time.monotonic() + 10
    while readyz(cluster.addr)[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert readyz(cluster.addr) == (200, ready)


async def test_readiness_follows_redis(cluster: Cluster) -> None:
    assert readyz(cluster.addr)[0] == 200
    cluster.redis.stop()
    try:
        status, body = readyz(cluster.addr)
        assert status == 503 and body["redis"] is False and body["ready"] is False
        metrics = httpx.get(f"http://{cluster.addr}/metrics", timeout=5)
        assert metrics.status_code == 200 and "tokenrelay_redis_up 0.0" in metrics.text
    finally:
        cluster.redis.start()
    await asyncio.get_running_loop().run_in_executor(
        None, wait_ready, cluster.addr, cluster.gateway, 30
    )
    assert readyz(cluster.addr)[0] == 200


DRAINED_TOKENS = 96


async def test_sigterm_gateway_drains_running_stream(cluster: Cluster) -> None:
    gw, addr = start_gateway(cluster.redis.url, PREFIX, cluster.logs, "--drain-timeout", "30")
    cluster.extra.append(gw)
    wait_ready(addr, gw, 60)
    c = await Client.open(addr)
    # long enough to be still running when SIGTERM lands (a fast engine writes 8 tokens first)
    params = {"max_tokens": DRAINED_TOKENS, "temperature": 0, "ignore_eos": True}
    await c.send(generate_frame("Tell me about rivers.", "d1", **params))
    frames = await c.recv_until(lambda f: f["type"] == "token", 60)
    sid = frames[-1]["stream_id"]
    gw.signal(signal.SIGTERM)
    frames += await c.recv_until(lambda f: f["type"] in ("notice", "done"), 10)
    notice = frames[-1]
    assert notice["type"] == "notice", frames
    assert notice["code"] == "shutting_down" and notice["drain_s"] == 30
    status, body = readyz(addr)  # still listening while it drains, but not ready
    assert status == 503 and body["ready"] is False
    await c.send(generate_frame("Hi", "d2", max_tokens=2))
    frames += await c.recv_until(lambda f: f["type"] in ("error", "done"), 60)
    if frames[-1]["type"] == "error":  # the refusal may come before the end of d1
        err = frames[-1]
        assert err["code"] == "unavailable" and err["request_id"] == "d2", err
        frames += await c.recv_until(lambda f: f["type"] == "done", 60)
    else:
        err = await c.recv(10)
        assert err["type"] == "error" and err["code"] == "unavailable", err
    done = frames[-1]
    assert done["stream_id"] == sid and done["finish_reason"] == "length"
    seqs = [f["seq"] for f in frames if f["type"] == "token"]
    assert seqs == list(range(1, done["seq"])) and len(seqs) == DRAINED_TOKENS
    with pytest.raises(ConnectionClosed) as closed:
        await c.recv(10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
    assert await wait_exit(gw, 20) == 0
    assert logged(gw, "drained")[-1]["streams_left"] == 0


async def test_sigterm_worker_finishes_running_and_hands_back_unstarted(cluster: Cluster) -> None:
    a = await Client.open(cluster.addr)
    b = await Client.open(cluster.addr)
    try:
        params = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
        await a.send(generate_frame("Tell me about lakes.", "wa", **params))
        frames = await a.recv_until(lambda f: f["type"] == "token", 60)
        sid_a = frames[-1]["stream_id"]
        # a long raw prompt: with 16 tokens per step its prefill takes many steps
        prompt = {"type": "generate", "request_id": "wb", "prompt": "stone " * 200,
                  "params": {"max_tokens": 3, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        await b.send(prompt)
        started_b = (await b.recv_until(lambda f: f.get("request_id") == "wb", 60))[-1]
        assert started_b["type"] == "started", started_b
        cluster.worker.signal(signal.SIGTERM)
        await b.close()  # nobody waits on b: it is resumed below, from another worker
        frames += await a.recv_until(lambda f: f["type"] in ("done", "error"), 60)
        done = frames[-1]
        assert done["type"] == "done" and done["stream_id"] == sid_a, done
        assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 6
    finally:
        await a.close()
    assert await wait_exit(cluster.worker, 30) == 0
    sid_b = started_b["stream_id"]
    assert [
        ln["stream_id"] for ln in logged(cluster.worker, "request handed back to the queue")
    ] == [sid_b]
    assert logged(cluster.worker, "worker stopped")[-1]["drained"] is True
    meta = cluster.redis.client().hgetall(Keys(PREFIX).meta(sid_b))
    assert meta[b"st"] == b"queued" and b"w" not in meta

    # another worker takes the handed-back request and runs it from scratch
    w2 = start_worker(cluster.redis.url, PREFIX, cluster.logs, "--worker-id", "drain-w2")
    cluster.extra.append(w2)
    wait_ready(cluster.addr, cluster.gateway, 300)
    r = await Client.open(cluster.addr)
    try:
        resume = {"type": "resume", "stream_id": sid_b,
                  "resume_token": started_b["resume_token"], "after": 0}  # fmt: skip
        await r.send(resume)
        frames = await r.recv_until(lambda f: f["type"] in ("done", "error"), 120)
        assert frames[0]["type"] == "resumed"
        done = frames[-1]
        assert done["type"] == "done" and done["finish_reason"] == "length", done
        assert [f["seq"] for f in frames if f["type"] == "token"] == list(range(1, done["seq"]))
        assert done["usage"]["completion_tokens"] == 3
    finally:
        await r.close()
    info = cluster.redis.client().hget(Keys(PREFIX).meta(sid_b), "w")
    assert info == b"drain-w2"
