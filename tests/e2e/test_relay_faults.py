"""Upstream failures through a fault-injecting proxy: each ends as the failure table says.

The fault relay (tests/worker/upstream/servers.py) reaches the upstream through
:class:`FaultProxy`:

| upstream fault               | what the relay's client gets                              |
| ---------------------------- | --------------------------------------------------------- |
| connection refused           | retried, then an ``error`` ``unavailable`` (HTTP 503)     |
| HTTP 503 before any token    | retried (``Retry-After`` honoured), then ``unavailable``  |
| HTTP 429 before any token    | retried (``Retry-After`` honoured), then ``overloaded``   |
| connection cut mid-stream    | ``done`` ``error`` "connection lost"; the text so far     |
|                              | stays readable and resumable                              |
| upstream stalls mid-stream   | ``done`` ``error`` after the chunk timeout, not a hang    |
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.gateway.procs import Client
from tests.worker.upstream.faultproxy import CUT, REFUSE, STALL, STATUS, FaultProxy
from tests.worker.upstream.servers import CHUNK_TIMEOUT, Server, run_ws, text_of

pytestmark = pytest.mark.slow

PROMPT = "Describe a walk along the beach."


async def test_a_refused_connection_is_retried_then_the_stream_is_unavailable(
    faults: FaultProxy, fault_relay: Server
) -> None:
    faults.set_mode(REFUSE)
    started = time.monotonic()
    frames = await run_ws(fault_relay.addr, PROMPT, "refused", max_tokens=8)
    elapsed = time.monotonic() - started
    assert [f["type"] for f in frames] == ["error"], frames
    assert frames[0]["code"] == "unavailable" and "unreachable" in frames[0]["message"]
    assert "4 attempts" in frames[0]["message"]
    assert 1.0 < elapsed < 15, elapsed  # backed off, then gave up: no hang
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    resp = httpx.post(f"{fault_relay.base}/chat/completions", json=body, timeout=60)
    assert resp.status_code == 503 and "unreachable" in resp.text, resp.text


@pytest.mark.parametrize(("status", "code"), [(503, "unavailable"), (429, "overloaded")])
async def test_an_overloaded_upstream_is_retried_after_its_retry_after(
    faults: FaultProxy, fault_relay: Server, status: int, code: str
) -> None:
    faults.set_mode(STATUS, status)
    seen = faults.connections
    started = time.monotonic()
    frames = await run_ws(fault_relay.addr, PROMPT, f"status-{status}", max_tokens=8)
    elapsed = time.monotonic() - started
    assert [f["type"] for f in frames] == ["error"], frames
    assert frames[0]["code"] == code and f"HTTP {status}" in frames[0]["message"], frames
    assert faults.connections - seen == 4  # four attempts ...
    assert elapsed >= 2.7, elapsed  # ... each after the upstream's Retry-After: 1


async def test_a_cut_mid_stream_ends_with_error_and_keeps_the_text_resumable(
    upstream: Server, faults: FaultProxy, fault_relay: Server
) -> None:
    full = text_of(await run_ws(upstream.addr, PROMPT, "ref", max_tokens=48, temperature=0))
    faults.set_mode(CUT, 1500)  # headers, the role chunk and a few tokens, then RST
    frames = await run_ws(fault_relay.addr, PROMPT, "cut", max_tokens=48, temperature=0)
    assert frames[0]["type"] == "started", frames
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "error", done
    assert "upstream connection lost" in done["message"]
    partial = text_of(frames)
    assert partial and full.startswith(partial) and partial != full
    # the partial answer stays in the log: a resume from 0 replays exactly it
    c = await Client.open(fault_relay.addr)
    await c.send({"type": "resume", "stream_id": frames[0]["stream_id"],
                  "resume_token": frames[0]["resume_token"], "after": 0})  # fmt: skip
    replay = await c.recv_until(lambda f: f["type"] in ("done", "error"))
    await c.close()
    tokens = [f for f in frames if f["type"] == "token"]
    assert [f for f in replay if f["type"] == "token"] == tokens
    assert replay[-1] == done


async def test_a_stalled_upstream_ends_the_stream_after_the_chunk_timeout(
    faults: FaultProxy, fault_relay: Server
) -> None:
    faults.set_mode(STALL, 1500)
    c = await Client.open(fault_relay.addr)
    await c.send({"type": "generate", "request_id": "stall", "prompt": PROMPT,
                  "params": {"max_tokens": 48, "temperature": 0}})  # fmt: skip
    frames = await c.recv_until(lambda f: f["type"] == "token")
    last_token = time.monotonic()
    frames += await c.recv_until(lambda f: f["type"] in ("done", "error"), 30)
    waited = time.monotonic() - last_token
    await c.close()
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "error", done
    assert f"sent nothing for {CHUNK_TIMEOUT:g} s" in done["message"]
    assert text_of(frames)
    assert CHUNK_TIMEOUT * 0.8 < waited < CHUNK_TIMEOUT + 8, waited
