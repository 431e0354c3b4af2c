"""Chaos: many concurrent streams whose clients keep dropping and resuming.

Every client drops its socket 1 to 3 times at random points (clean closes and
abrupt TCP cuts) and resumes with the last seq it saw, on either gateway.
Each assembled text must equal the uninterrupted greedy text for its prompt
(the same prompt streamed at the same time on a socket that never drops), and
the token seqs must be exactly 1..n-1: no gap, no duplicate.

TOKENRELAY_CHAOS_STREAMS / TOKENRELAY_CHAOS_TOKENS resize it (default 50 x 48).
The helpers take any two gateways (:class:`Gateways`): test_chaos_relay.py runs them
over a relay, test_chaos_grpc.py over gRPC, cluster/test_chaos_cluster.py on a Redis
Cluster.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest

from tests.gateway.procs import Client, generate_frame
from tests.gateway.stack import Stack


class Gateways(Protocol):
    """Two gateways of one fleet (``host:port``): clients start on ``a``, resume on either."""

    a: str
    b: str


# 2 x 50 streams x 48 tokens of CPU inference: minutes on a busy 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

STREAMS = int(os.environ.get("TOKENRELAY_CHAOS_STREAMS", "50"))
TOKENS = int(os.environ.get("TOKENRELAY_CHAOS_TOKENS", "48"))
TOPICS = ["rivers", "owls", "bread", "Mars", "chess", "tea", "glass", "maps", "snow", "bees"]


def prompt(i: int) -> str:
    return f"In one sentence, tell me fact number {i} about {TOPICS[i % len(TOPICS)]}."


def params(tokens: int = TOKENS) -> dict[str, Any]:
    return {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}


@dataclass
class Outcome:
    seqs: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    done: dict[str, Any] | None = None
    drops: list[str] = field(default_factory=list)
    resumed_on: list[str] = field(default_factory=list)


async def reference(addr: str, streams: int = STREAMS, tokens: int = TOKENS) -> list[Outcome]:
    """All prompts on one socket (to the gateway at ``addr``) that never drops."""
    c = await Client.open(addr)
    out: dict[int, Outcome] = {}
    by_sid: dict[str, int] = {}
    try:
        for i in range(streams):
            await c.send(generate_frame(prompt(i), f"ref{i}", **params(tokens)))
        while len(out) < streams or any(o.done is None for o in out.values()):
            f = await c.recv(120)
            if f["type"] == "started":
                i = int(f["request_id"][3:])
                by_sid[f["stream_id"]] = i
                out[i] = Outcome()
            elif f["type"] == "token":
                o = out[by_sid[f["stream_id"]]]
                o.seqs.append(f["seq"])
                o.text.append(f["text"])
            elif f["type"] == "done":
                out[by_sid[f["stream_id"]]].done = f
            else:
                raise AssertionError(f)
    finally:
        await c.close()
    return [out[i] for i in range(streams)]


async def read_some(c: Any, out: Outcome, budget: int) -> None:
    """Read up to ``budget`` token frames of a protocol v1 client ``c`` (a WebSocket or a
    gRPC call) into ``out``, or up to its ``done``."""
    while budget > 0 and out.done is None:
        f = await c.recv(120)
        if f["type"] == "token":
            out.seqs.append(f["seq"])
            out.text.append(f["text"])
            budget -= 1
        elif f["type"] == "done":
            out.done = f
        elif f["type"] != "resumed":
            raise AssertionError(f)


@dataclass(frozen=True)
class Channel:
    """How a chaos client speaks protocol v1: over a WebSocket unless told otherwise
    (tests/e2e/test_chaos_grpc.py gives the gRPC call's)."""

    open: Callable[[str], Awaitable[Any]] = Client.open
    generate: Callable[[str, str, dict[str, Any]], Any] = lambda text, rid, p: generate_frame(
        text, rid, **p
    )
    resume: Callable[[str, str, int], Any] = lambda sid, token, after: {
        "type": "resume", "stream_id": sid, "resume_token": token, "after": after
    }  # fmt: skip


async def chaos_client(
    stack: Gateways, i: int, rng: random.Random, tokens: int = TOKENS, via: Channel = Channel()
) -> Outcome:
    """Stream prompt ``i``, dropping the channel 1 to 3 times (a close, or the connection
    cut under it) and resuming on either gateway."""
    out = Outcome()
    c = await via.open(stack.a)
    await c.send(via.generate(prompt(i), f"chaos{i}", params(tokens)))
    started = (await c.recv_until(lambda f: f["type"] == "started", 120))[-1]
    sid, token = started["stream_id"], started["resume_token"]
    drops = rng.randint(1, 3)
    while True:
        budget = rng.randint(0, 12) if drops > 0 else 10**9
        await read_some(c, out, budget)
        if out.done is not None:
            await c.close()
            return out
        drops -= 1
        if rng.random() < 0.5:
            out.drops.append("close")  # a detach
            await c.close()
        else:
            out.drops.append("cut")
            if inspect.isawaitable(cut := c.cut()):  # a gRPC channel closes asynchronously
                await cut
        await asyncio.sleep(rng.uniform(0, 0.4))
        addr = rng.choice([stack.a, stack.b])
        out.resumed_on.append("a" if addr == stack.a else "b")
        c = await via.open(addr)
        after = out.seqs[-1] if out.seqs else 0
        await c.send(via.resume(sid, token, after))
        first = await c.recv(30)
        assert first == {"type": "resumed", "stream_id": sid, "after": after}, first


async def test_chaos_drops_and_resumes(stack: Stack) -> None:
    rng = random.Random(1234)
    seeds = [rng.randrange(2**32) for _ in range(STREAMS)]
    ref_task = asyncio.create_task(reference(stack.a))
    chaos = await asyncio.wait_for(
        asyncio.gather(*(chaos_client(stack, i, random.Random(seeds[i])) for i in range(STREAMS))),
        1500,
    )
    check_assembled(chaos, await asyncio.wait_for(ref_task, 300), TOKENS)


def check_assembled(chaos: list[Outcome], refs: list[Outcome], tokens: int) -> None:
    """Every chaos stream was dropped and resumed (both ways, on both gateways), and
    assembled the reference's text with seqs 1..n-1, no gap and no duplicate."""
    cuts = sum(o.drops.count("cut") for o in chaos)
    closes = sum(o.drops.count("close") for o in chaos)
    on_b = sum(o.resumed_on.count("b") for o in chaos)
    assert cuts > 0 and closes > 0 and on_b > 0, (cuts, closes, on_b)
    for i, (o, ref) in enumerate(zip(chaos, refs, strict=True)):
        assert o.done is not None and ref.done is not None
        assert o.seqs == list(range(1, o.done["seq"])), f"stream {i}: gap or duplicate {o.seqs}"
        assert o.done["finish_reason"] == "length", o.done
        assert "".join(o.text) == "".join(ref.text), f"stream {i} ({o.drops}) differs"
        assert 1 <= len(o.drops) <= 3
        assert o.done["usage"]["completion_tokens"] == tokens
