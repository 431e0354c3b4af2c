"""A relay in front of a real OpenAI-compatible server: same answers, resumable, a real Stop.

The upstream is a second ``tokenrelay serve`` with the default model; the relay is
``tokenrelay serve --upstream`` (servers.py). Greedy decoding makes the upstream's
answer a fixed text, so the relay's must equal it, token events and all.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.core.test_serve import children, cmdline
from tests.gateway.procs import Client, generate_frame
from tests.worker.upstream.faultproxy import FaultProxy
from tests.worker.upstream.servers import DETACH_TIMEOUT, Server, run_ws, text_of, wait_for

pytestmark = pytest.mark.slow

PROMPT = "Name three colours of the rainbow."


async def test_a_generate_through_the_relay_gives_the_upstreams_answer(
    upstream: Server, relay: Server
) -> None:
    direct = await run_ws(upstream.addr, PROMPT, "direct", max_tokens=24, temperature=0)
    relayed = await run_ws(relay.addr, PROMPT, "relayed", max_tokens=24, temperature=0)
    assert direct[-1]["type"] == "done" and relayed[-1]["type"] == "done", relayed
    assert text_of(relayed) == text_of(direct) != ""
    assert relayed[-1]["finish_reason"] == direct[-1]["finish_reason"]
    assert relayed[-1]["usage"] == direct[-1]["usage"]  # the upstream's own usage chunk
    seqs = [f["seq"] for f in relayed if f["type"] in ("token", "done")]
    assert seqs == list(range(1, len(seqs) + 1))


def test_a_prompt_request_goes_to_the_upstreams_completions(
    upstream: Server, relay: Server
) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    direct = httpx.post(f"{upstream.base}/completions", json=body, timeout=60)
    relayed = httpx.post(f"{relay.base}/completions", json=body, timeout=60)
    assert direct.status_code == relayed.status_code == 200, relayed.text
    assert relayed.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"] != ""
    assert relayed.json()["usage"] == direct.json()["usage"]


async def test_a_resume_mid_stream_on_the_relay_has_no_gap_and_no_duplicate(
    upstream: Server, relay: Server
) -> None:
    full = text_of(await run_ws(upstream.addr, PROMPT, "ref", max_tokens=32, temperature=0))
    c = await Client.open(relay.addr)
    await c.send(generate_frame(PROMPT, "resume", max_tokens=32, temperature=0))
    started = await c.recv()
    assert started["type"] == "started", started
    first = await c.recv_until(lambda f: f["type"] == "token" and f["seq"] >= 3)
    c.cut()  # the network drops: the relay keeps generating (detach timeout)
    await asyncio.sleep(0.5)
    c2 = await Client.open(relay.addr)
    last = first[-1]["seq"]
    await c2.send({"type": "resume", "stream_id": started["stream_id"],
                   "resume_token": started["resume_token"], "after": last})  # fmt: skip
    rest = await c2.recv_until(lambda f: f["type"] in ("done", "error"))
    await c2.close()
    assert rest[0]["type"] == "resumed" and rest[0]["after"] == last, rest[0]
    seqs = [f["seq"] for f in first + rest if f["type"] in ("token", "done")]
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    assert text_of(first) + text_of(rest) == full


async def test_a_cancel_on_the_relay_ends_the_request_on_the_upstream(
    upstream: Server, relay: Server
) -> None:
    cancelled = "tokenrelay_requests_finished_total"
    before = upstream.metric(cancelled, finish_reason="cancelled")
    left = upstream.metric("tokenrelay_disconnects_total")
    c = await Client.open(relay.addr)
    await c.send(generate_frame("Write a long story about the sea.", "stop", max_tokens=400))
    started = await c.recv()
    await c.recv_until(lambda f: f["type"] == "token" and f["seq"] >= 2)
    await c.send({"type": "cancel", "stream_id": started["stream_id"]})
    frames = await c.recv_until(lambda f: f["type"] == "done", 30)
    await c.close()
    assert frames[-1]["finish_reason"] == "cancelled"
    assert frames[-1]["usage"]["completion_tokens"] < 100  # stopped early, not after 400

    def upstream_stopped() -> bool:
        return upstream.metric(cancelled, finish_reason="cancelled") >= before + 1

    await wait_for(upstream_stopped, 15, "the upstream's stream to end cancelled")
    assert upstream.metric("tokenrelay_disconnects_total") >= left + 1  # its connection closed


async def test_a_client_that_never_comes_back_stops_the_relay_and_the_upstream(
    upstream: Server, faults: FaultProxy, fault_relay: Server
) -> None:
    """The detach timeout works as for our engine (fault_relay: 2 s, the proxy passing)."""
    cancelled = "tokenrelay_requests_finished_total"
    before = upstream.metric(cancelled, finish_reason="cancelled")
    c = await Client.open(fault_relay.addr)
    await c.send(generate_frame("Write a long story about the sea.", "gone", max_tokens=400))
    started = await c.recv()
    await c.recv_until(lambda f: f["type"] == "token")
    c.cut()
    left = asyncio.get_running_loop().time()

    def upstream_stopped() -> bool:
        return upstream.metric(cancelled, finish_reason="cancelled") >= before + 1

    await wait_for(upstream_stopped, DETACH_TIMEOUT + 15, "the upstream's stream to end")
    assert asyncio.get_running_loop().time() - left >= DETACH_TIMEOUT * 0.9
    c2 = await Client.open(fault_relay.addr)
    await c2.send({"type": "resume", "stream_id": started["stream_id"],
                   "resume_token": started["resume_token"], "after": 0})  # fmt: skip
    frames = await c2.recv_until(lambda f: f["type"] in ("done", "error"))
    await c2.close()
    assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "expired", frames[-1]


def test_the_relay_worker_runs_without_torch(relay: Server) -> None:
    workers = [k for k in children(relay.proc.pid) if " worker " in cmdline(k)]
    assert len(workers) == 1, [cmdline(k) for k in children(relay.proc.pid)]
    maps = Path(f"/proc/{workers[0]}/maps").read_text()
    assert "libtorch" not in maps and "/torch/" not in maps
