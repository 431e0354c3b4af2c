"""Faults with real processes: Redis restarting under a stream, a worker killed with SIGKILL.

This module has its own redis-server (so it can be restarted), engine worker
and gateway.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

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

PROMPT = "Explain how a bicycle works."
PARAMS = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


@dataclass
class Faulty:
    redis: EmbeddedRedis
    worker: Proc
    gateway: Proc
    addr: str
    logs: Path


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    logs = tmp_path_factory.mktemp("fault-logs")
    redis = EmbeddedRedis(tmp_path_factory.mktemp("fault-redis")).start()
    worker = start_worker(redis.url, "f:", logs, "--worker-id", "fault-worker")
    gateway, addr = start_gateway(redis.url, "f:", logs)
    try:
        wait_ready(addr, gateway, 300)
        yield Faulty(redis, worker, gateway, addr, logs)
    finally:
        stop_all([gateway, worker])
        redis.cleanup()


async def run_uninterrupted(addr: str) -> str:
    c = await Client.open(addr)
    try:
        await c.send(generate_frame(PROMPT, "ref", **PARAMS))
        frames = await c.recv_until(lambda f: f["type"] in ("done", "error"), 120)
        assert frames[-1]["type"] == "done", frames[-1]
        return "".join(f["text"] for f in frames if f["type"] == "token")
    finally:
        await c.close()


async def wait_ready_async(addr: str, proc: Proc, timeout: float = 30.0) -> None:
    await asyncio.get_running_loop().run_in_executor(None, wait_ready, addr, proc, timeout)


async def test_redis_restart_mid_stream_loses_nothing(faulty: Faulty) -> None:
    expected = await run_uninterrupted(faulty.addr)
    c = await Client.open(faulty.addr)
    try:
        await c.send(generate_frame(PROMPT, "r", **PARAMS))
        started = (await c.recv_until(lambda f: f["type"] == "started", 60))[-1]
        sid, token = started["stream_id"], started["resume_token"]
        frames = await c.recv_until(lambda f: f.get("seq", 0) >= 5, 60)
        seqs = [f["seq"] for f in frames if f["type"] == "token"]
        text = [f["text"] for f in frames if f["type"] == "token"]
        faulty.redis.stop()
        # the stream's tail reports the outage; the socket itself stays usable
        frames = await c.recv_until(lambda f: f["type"] == "error", 15)
        for f in frames[:-1]:
            seqs.append(f["seq"])
            text.append(f["text"])
        assert frames[-1]["code"] == "unavailable" and frames[-1]["stream_id"] == sid
        await c.send(generate_frame("Hi", "during", max_tokens=2))
        err = await c.recv(10)
        assert err["type"] == "error" and err["code"] == "unavailable"
        assert err["request_id"] == "during"
        await c.send({"type": "ping"})
        assert await c.recv() == {"type": "pong"}
        await asyncio.sleep(1.0)
        faulty.redis.start()
        await wait_ready_async(faulty.addr, faulty.gateway)
        await c.send({"type": "resume", "stream_id": sid, "resume_token": token, "after": seqs[-1]})
        frames = await c.recv_until(lambda f: f["type"] in ("done", "error"), 120)
        assert frames[0]["type"] == "resumed"
        done = frames[-1]
        assert done["type"] == "done" and done["finish_reason"] == "length", done
        seqs += [f["seq"] for f in frames if f["type"] == "token"]
        text += [f["text"] for f in frames if f["type"] == "token"]
        assert seqs == list(range(1, done["seq"]))
        assert "".join(text) == expected
    finally:
        await c.close()
    logs = faulty.worker.log_text() + faulty.gateway.log_text()
    assert "Traceback" not in logs
    assert faulty.worker.log_text().count("redis is unreachable") <= 2  # one line per outage


async def test_killed_worker_ends_its_streams_with_error(faulty: Faulty) -> None:
    c = await Client.open(faulty.addr)
    try:
        await c.send(generate_frame(PROMPT, "k", **{**PARAMS, "max_tokens": 4000}))
        started = (await c.recv_until(lambda f: f["type"] == "started", 60))[-1]
        sid = started["stream_id"]
        await c.recv_until(lambda f: f.get("seq", 0) >= 2, 60)
        faulty.worker.signal(signal.SIGKILL)
        killed = time.monotonic()
        frames = await c.recv_until(lambda f: f["type"] in ("done", "error"), 20)
        elapsed = time.monotonic() - killed
        done = frames[-1]
        assert done["type"] == "done" and done["stream_id"] == sid
        assert done["finish_reason"] == "error" and "fault-worker" in done["message"]
        assert elapsed < 8, elapsed
        seqs = [f["seq"] for f in frames if f["type"] == "token"]
        assert seqs == list(range(seqs[0], done["seq"])) if seqs else True
        # with no worker left, new requests are refused rather than left hanging
        await asyncio.sleep(1.5)
        await c.send(generate_frame("Hi", "nobody", max_tokens=2))
        err = await c.recv(15)
        assert err["type"] == "error" and err["code"] == "unavailable", err
    finally:
        await c.close()
