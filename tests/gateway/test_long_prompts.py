"""Long prompts: refused early when they cannot fit, and never stall running streams.

Real gateways, the real engine worker and the real default model (the session
``stack``). Tokenizing 65,000 characters takes about a quarter of a second; the
worker does it on a thread beside its engine loop (worker/prepare.py), so a burst
of such prompts costs running streams no more than a busy CPU does.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import string
import time
from typing import Any

import httpx
import pytest

from tests.gateway.procs import Client, generate_frame
from tests.gateway.stack import Stack
from tokenrelay.core.wire.requests import CHARS_PER_TOKEN

pytestmark = pytest.mark.slow

BURST = 64
SOCKETS = 4
MAX_GAP_S = 1.0  # the bound on a running stream's longest pause during the burst


def context_tokens(stack: Stack) -> int:
    ctx = int(stack.worker_stats().get("max_model_len", 0))
    assert ctx > 0, stack.worker_stats()
    return ctx


def dense_text(chars: int, seed: int) -> str:
    """Text the tokenizer splits finely (about 1.3 characters per token)."""
    rng = random.Random(seed)
    return "".join(rng.choices(string.ascii_letters + string.digits + " ", k=chars))


async def test_an_input_beyond_the_context_is_refused_by_the_gateway(stack: Stack) -> None:
    bound = context_tokens(stack) * CHARS_PER_TOKEN
    c = await Client.open(stack.a)
    try:
        await c.send(generate_frame("x" * (bound + 1), "too-long"))
        err = (await c.recv_until(lambda f: f.get("request_id") == "too-long", 10))[-1]
        assert err["type"] == "error" and err["code"] == "too_large", err
        assert "context" in err["message"], err
    finally:
        await c.close()
    body = {"model": "default", "messages": [{"role": "user", "content": "y" * (bound + 1)}]}
    async with httpx.AsyncClient(base_url=f"http://{stack.a}", timeout=10) as http:
        r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 413, r.text
    assert "context" in r.json()["error"]["message"]


async def test_a_burst_of_long_prompts_does_not_stall_a_running_stream(stack: Stack) -> None:
    bound = context_tokens(stack) * CHARS_PER_TOKEN
    runner = await Client.open(stack.a)
    senders = [await Client.open(stack.a) for _ in range(SOCKETS)]
    arrivals: list[float] = []
    # just under the gateway's bound: accepted, tokenized, then too long for the context
    # (made before the stream starts: this takes the test's own loop most of a second)
    prompts = [dense_text(bound - 1, seed=i) for i in range(BURST)]
    try:
        await runner.send(
            generate_frame(
                "Count to a thousand.", "runner", max_tokens=4000, temperature=0, ignore_eos=True
            )
        )
        started = (await runner.recv_until(lambda f: f.get("request_id") == "runner", 60))[-1]
        assert started["type"] == "started", started
        sid = started["stream_id"]

        async def follow() -> None:
            while True:
                frame = await runner.recv(60)
                if frame.get("stream_id") != sid:
                    continue
                if frame["type"] != "token":
                    return
                arrivals.append(time.monotonic())

        follower = asyncio.create_task(follow())
        while len(arrivals) < 5:
            await asyncio.sleep(0.05)
        burst_start = time.monotonic()
        for i, prompt in enumerate(prompts):
            await senders[i % SOCKETS].send(generate_frame(prompt, f"long-{i}"))

        results = await asyncio.gather(
            *(outcomes(c, len(range(k, BURST, SOCKETS))) for k, c in enumerate(senders))
        )
        burst_end = time.monotonic()
        assert not follower.done(), "the running stream ended during the burst"
        frames = [f for fs in results for f in fs]
        assert len(frames) == BURST, frames
        for f in frames:
            assert f["type"] == "error" and f["code"] == "bad_request", f
            assert "context" in f["message"], f
        before = [t for t in arrivals if t < burst_start][-1:]
        window = [*before, *(t for t in arrivals if burst_start <= t <= burst_end), burst_end]
        gaps = [b - a for a, b in itertools.pairwise(window)]
        took = burst_end - burst_start
        assert len(window) > 10, (len(window), took)
        i = max(range(len(gaps)), key=gaps.__getitem__)
        where = f"{gaps[i]:.3f} s at {window[i] - burst_start:.2f} s of a {took:.1f} s burst"
        assert gaps[i] < MAX_GAP_S, where
        await runner.send({"type": "cancel", "stream_id": sid})
        await asyncio.wait_for(follower, 30)
    finally:
        for c in (runner, *senders):
            await c.close()


async def outcomes(c: Client, count: int, timeout: float = 300) -> list[dict[str, Any]]:
    """The first ``count`` outcomes (``error`` or ``started``) of burst requests on ``c``."""
    got: list[dict[str, Any]] = []
    while len(got) < count:
        frame = await c.recv(timeout)
        if str(frame.get("request_id", "")).startswith("long-") and frame["type"] in (
            "error",
            "started",
        ):
            got.append(frame)
    return got
