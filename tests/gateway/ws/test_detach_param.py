"""A ``generate`` that asks for a longer ``detach_timeout`` than its gateway's, end to end.

Gateway b of the session's stack runs with ``--detach-timeout 3``: a stream left with no
client keeps generating past those 3 s when its request asks for more, and is resumed to
its end, while a stream that asked for nothing expires.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.gateway.procs import Client, generate_frame
from tests.gateway.stack import Stack
from tokenrelay.core.wire.keys import Keys

DEFAULT_S = 3.0  # gateway b's --detach-timeout
PAST_DEFAULT_S = 5.5  # past it, with the worker's polling and the gateway's detach


def is_done(sid: str) -> Any:
    return lambda f: f.get("stream_id") == sid and f["type"] in ("done", "error")


def meta(stack: Stack, sid: str) -> dict[str, str]:
    raw: dict[bytes, bytes] = stack.redis.client().hgetall(Keys(stack.prefix).meta(sid))  # type: ignore[assignment]
    return {k.decode(): v.decode() for k, v in raw.items()}


async def start(c: Client, rid: str, **params: Any) -> dict[str, Any]:
    await c.send(generate_frame("Describe the sea at length.", rid, **params))
    frames = await c.recv_until(lambda f: f.get("request_id") == rid, 60)
    assert frames[-1]["type"] == "started", frames[-1]
    return frames[-1]


async def tokens_per_second(stack: Stack) -> float:
    """This worker's decode speed now (between the 8th and the 40th token: no prefill)."""
    c = await Client.open(stack.a)
    try:
        started = await start(c, "speed", max_tokens=40, temperature=0, ignore_eos=True)
        sid = started["stream_id"]
        await c.recv_until(lambda f: f.get("stream_id") == sid and f.get("seq", 0) >= 8)
        t0 = time.monotonic()
        await c.recv_until(lambda f: f.get("stream_id") == sid and f.get("seq", 0) >= 40)
        return 32 / max(time.monotonic() - t0, 1e-3)
    finally:
        await c.close()


async def test_a_longer_detach_timeout_keeps_generating_and_resumes_to_the_end(
    stack: Stack,
) -> None:
    # about 15 s of tokens: still running when the gateway's 3 s are long gone
    max_tokens = max(200, min(4000, int(await tokens_per_second(stack) * 15)))
    c = await Client.open(stack.b)
    try:
        kept = await start(c, "kept", max_tokens=max_tokens, temperature=0, ignore_eos=True,
                           detach_timeout=60)  # fmt: skip
        gone = await start(c, "gone", max_tokens=4000, temperature=0, ignore_eos=True)
        frames = await c.recv_until(
            lambda f: f.get("stream_id") == kept["stream_id"] and f.get("seq", 0) >= 3
        )
    finally:
        await c.close()  # a disconnect: both streams detach
    seen = frames[-1]["seq"]
    await asyncio.sleep(PAST_DEFAULT_S)
    gone_meta = meta(stack, gone["stream_id"])
    assert gone_meta.get("st") == "done" and gone_meta.get("fr") == "expired", gone_meta
    kept_meta = meta(stack, kept["stream_id"])
    assert kept_meta.get("st") == "running", kept_meta  # no client for 5.5 s: not expired

    d = await Client.open(stack.b)
    try:
        sid = kept["stream_id"]
        await d.send({"type": "resume", "stream_id": sid, "resume_token": kept["resume_token"],
                      "after": seen})  # fmt: skip
        rest = await d.recv_until(is_done(sid), 120)
    finally:
        await d.close()
    assert rest[0]["type"] == "resumed"
    done = rest[-1]
    assert done["type"] == "done" and done["finish_reason"] == "length", done
    assert done["usage"]["completion_tokens"] == max_tokens
    tokens = [f["seq"] for f in rest if f["type"] == "token"]
    assert tokens == list(range(seen + 1, done["seq"]))  # no gap: it never stopped
    assert len(tokens) > 3  # generated while nobody was attached, and after


async def test_over_the_gateways_cap_is_refused_naming_it(stack: Stack) -> None:
    c = await Client.open(stack.b)
    try:
        assert c.hello["detach_timeout"] == DEFAULT_S and c.hello["max_detach_timeout"] == 600
        await c.send(generate_frame("Hi", "capped", max_tokens=4, detach_timeout=601))
        frames = await c.recv_until(lambda f: f.get("request_id") == "capped", 30)
    finally:
        await c.close()
    err = frames[-1]
    assert err["type"] == "error" and err["code"] == "bad_request"
    assert "--max-detach-timeout" in err["message"] and "600" in err["message"]
