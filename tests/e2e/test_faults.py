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
from typing import Any

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
from tokenrelay.worker.continuation import MAX_TAKEOVERS

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
    return await run_uninterrupted_with(addr, PARAMS)


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


async def test_killed_worker_restarted_continues_its_stream(faulty: Faulty) -> None:
    """SIGKILL the only worker mid-stream: the stream waits (no error), new requests are
    refused while no worker lives, and a new worker (another id, as serve's restart
    gives) takes the stream over and finishes it: gapless seqs, the uninterrupted text."""
    params = {**PARAMS, "max_tokens": 48}
    ref = await run_uninterrupted_with(faulty.addr, params)
    c = await Client.open(faulty.addr)
    try:
        await c.send(generate_frame(PROMPT, "k", **params))
        started = (await c.recv_until(lambda f: f["type"] == "started", 60))[-1]
        sid = started["stream_id"]
        before = await c.recv_until(lambda f: f.get("seq", 0) >= 8, 60)
        faulty.worker.signal(signal.SIGKILL)
        # with no worker left, new requests are refused rather than left hanging
        await asyncio.sleep(1.5)
        other = await Client.open(faulty.addr)
        try:
            await other.send(generate_frame("Hi", "nobody", max_tokens=2))
            err = await other.recv(15)
            assert err["type"] == "error" and err["code"] == "unavailable", err
        finally:
            await other.close()
        faulty.worker = start_worker(faulty.redis.url, "f:", faulty.logs, "--worker-id", "heir")
        frames = before + await c.recv_until(lambda f: f["type"] in ("done", "error"), 120)
        done = frames[-1]
        assert done["type"] == "done" and done["stream_id"] == sid, done
        assert done["finish_reason"] == "length", done
        tokens = [f for f in frames if f["type"] == "token"]
        assert [f["seq"] for f in tokens] == list(range(1, done["seq"]))
        assert "".join(f["text"] for f in tokens) == ref
        assert done["usage"]["completion_tokens"] == 48
    finally:
        await c.close()
    assert "continuing the stream of a dead worker" in faulty.worker.log_text()


async def run_uninterrupted_with(addr: str, params: dict[str, Any]) -> str:
    c = await Client.open(addr)
    try:
        await c.send(generate_frame(PROMPT, "ref", **params))
        frames = await c.recv_until(lambda f: f["type"] in ("done", "error"), 120)
        assert frames[-1]["type"] == "done", frames[-1]
        return "".join(f["text"] for f in frames if f["type"] == "token")
    finally:
        await c.close()


async def test_sse_stream_goes_on_after_its_worker_is_killed(faulty: Faulty) -> None:
    """The same over the OpenAI-compatible SSE endpoint: the open response pauses, then
    the next chunks come from the new worker, and the text is the uninterrupted one."""
    from openai import AsyncOpenAI

    params = {**PARAMS, "max_tokens": 40}
    ref = await run_uninterrupted_with(faulty.addr, params)
    client = AsyncOpenAI(base_url=f"http://{faulty.addr}/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            timeout=120,
        )
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 8:  # a few tokens in: kill it, start another
                faulty.worker.signal(signal.SIGKILL)
                faulty.worker = start_worker(
                    faulty.redis.url, "f:", faulty.logs, "--worker-id", "sse-heir"
                )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ref
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons[-1] == "length"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 40
    finally:
        await client.close()


async def test_a_request_that_kills_every_worker_ends_with_error(faulty: Faulty) -> None:
    """A stream whose worker dies each time it runs is taken over a few times, then ended
    with an error saying so (one bad request cannot crash-loop the fleet)."""
    fast = {"TOKENRELAY_WORKER_DEAD_AFTER": "1.5"}
    c = await Client.open(faulty.addr)
    try:
        await c.send(generate_frame(PROMPT, "poison", **{**PARAMS, "max_tokens": 4000}))
        sid = (await c.recv_until(lambda f: f["type"] == "started", 60))[-1]["stream_id"]
        redis = faulty.redis.client()
        meta = f"f:m:{{{sid}}}"
        for n in range(1, MAX_TAKEOVERS + 2):
            await c.recv_until(lambda f: f["type"] in ("token", "done"), 60)
            owner = redis.hget(meta, "w")
            faulty.worker.signal(signal.SIGKILL)
            faulty.worker = start_worker(
                faulty.redis.url, "f:", faulty.logs, "--worker-id", f"p{n}", env=fast
            )
            if n > MAX_TAKEOVERS:
                break
            deadline = time.monotonic() + 60
            while redis.hget(meta, "w") == owner:  # wait for the takeover
                assert time.monotonic() < deadline, "not taken over"
                await asyncio.sleep(0.1)
        frames = await c.recv_until(lambda f: f["type"] in ("done", "error"), 60)
        done = frames[-1]
        assert done["type"] == "done" and done["finish_reason"] == "error", done
        assert f"stopped {MAX_TAKEOVERS + 1} times" in done["message"], done
        assert redis.hget(meta, "to") == str(MAX_TAKEOVERS + 1).encode()
    finally:
        await c.close()
