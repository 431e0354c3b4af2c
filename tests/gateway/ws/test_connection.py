"""``/v1/ws`` end to end: real gateways, a real engine worker, the real default model."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed

from tests.gateway.procs import Client, generate_frame
from tests.gateway.stack import Stack

LONG = {"max_tokens": 4000, "temperature": 0, "ignore_eos": True}


def is_done(sid: str) -> Any:
    return lambda f: f.get("stream_id") == sid and f["type"] in ("done", "error")


async def start(c: Client, prompt: str, rid: str, **params: Any) -> dict[str, Any]:
    await c.send(generate_frame(prompt, rid, **params))
    frames = await c.recv_until(lambda f: f.get("request_id") == rid, 60)
    started = frames[-1]
    assert started["type"] == "started", started
    return started


async def wait_blocks_free(stack: Stack, expected: int, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    stats = stack.worker_stats()
    while time.monotonic() < deadline:
        stats = stack.worker_stats()
        if stats.get("blocks_free") == expected and stats.get("running") == 0:
            return stats
        await asyncio.sleep(0.2)
    raise AssertionError(f"blocks not freed: {stats}")


async def test_hello_ping_and_a_stream(stack: Stack) -> None:
    c = await Client.open(stack.a)
    try:
        assert c.hello["protocol"] == 1 and c.hello["heartbeat_s"] > 0
        await c.send({"type": "ping"})
        assert await c.recv() == {"type": "pong"}
        started = await start(c, "Say hello.", "r1", max_tokens=12, temperature=0)
        sid = started["stream_id"]
        assert started["prompt_tokens"] > 0 and len(started["resume_token"]) >= 32
        frames = await c.recv_until(is_done(sid))
        tokens, done = frames[:-1], frames[-1]
        assert done["type"] == "done" and done["finish_reason"] in ("stop", "length")
        assert [f["seq"] for f in tokens] == list(range(1, done["seq"]))
        assert done["usage"]["prompt_tokens"] == started["prompt_tokens"]
        assert 0 < done["usage"]["completion_tokens"] <= 12
    finally:
        await c.close()


async def test_several_streams_on_one_socket(stack: Stack) -> None:
    c = await Client.open(stack.a)
    try:
        for i in range(4):
            await c.send(
                generate_frame(f"Count to {i + 3}.", f"m{i}", max_tokens=10, temperature=0)
            )
        sids: dict[str, str] = {}
        seqs: dict[str, list[int]] = {}
        finished: set[str] = set()
        while len(finished) < 4:
            f = await c.recv()
            if f["type"] == "started":
                sids[f["stream_id"]] = f["request_id"]
                seqs[f["stream_id"]] = []
            elif f["type"] == "token":
                seqs[f["stream_id"]].append(f["seq"])
            elif f["type"] == "done":
                assert seqs[f["stream_id"]] == list(range(1, f["seq"]))
                finished.add(f["stream_id"])
            else:
                raise AssertionError(f)
        assert sorted(sids.values()) == ["m0", "m1", "m2", "m3"]
    finally:
        await c.close()


BAD_FRAMES: list[tuple[str, str]] = [
    ("not json", "bad_request"),
    ("[]", "bad_request"),
    ('{"type": 3}', "bad_request"),
    ('{"type": "fly"}', "bad_request"),
    ('{"request_id": "x"}', "bad_request"),
    ('{"type": "generate", "request_id": "g"}', "bad_request"),
    ('{"type": "generate", "prompt": 12}', "bad_request"),
    ('{"type": "generate", "messages": [{"role": "robot", "content": "x"}]}', "bad_request"),
    ('{"type": "generate", "prompt": "x", "params": {"temperature": "hot"}}', "bad_request"),
    ('{"type": "generate", "prompt": "x", "params": {"max_tokens": -3}}', "bad_request"),
    ('{"type": "generate", "prompt": "x", "params": {"bogus": 1}}', "bad_request"),
    ('{"type": "resume", "stream_id": "AAAAAAAAAAAAAAAAAAAAAA", "resume_token": "t"}', "not_found"),
    ('{"type": "resume", "stream_id": 5}', "bad_request"),
    ('{"type": "cancel"}', "bad_request"),
    ('{"type": "cancel", "stream_id": "AAAAAAAAAAAAAAAAAAAAAA"}', "not_found"),
    (json.dumps({"type": "generate", "prompt": "x" * 250_000}), "too_large"),
]


async def test_malformed_frames_get_errors_and_the_socket_survives(stack: Stack) -> None:
    c = await Client.open(stack.a)
    try:
        for raw, code in BAD_FRAMES:
            await c.send(raw)
            reply = await c.recv(10)
            assert reply["type"] == "error" and reply["code"] == code, (raw[:80], reply)
            assert reply["message"]
        await c.ws.send(b"\x00\x01binary")
        reply = await c.recv(10)
        assert reply["type"] == "error" and reply["code"] == "bad_request"
        # a bad request coming back from the engine (prompt too long for the model)
        await c.send(generate_frame("hi " * 30_000, "toolong", max_tokens=4))
        reply = await c.recv(60)
        assert reply["type"] == "error" and reply["request_id"] == "toolong", reply
        assert reply["code"] in ("bad_request", "too_large")
        await c.send({"type": "ping"})
        assert await c.recv() == {"type": "pong"}
        started = await start(c, "Hi", "ok", max_tokens=3, temperature=0)
        frames = await c.recv_until(is_done(started["stream_id"]))
        assert frames[-1]["type"] == "done"
        # over --max-frame-bytes: the only malformed frame that closes the socket (1009). The
        # server may close while the client is still writing the frame: then the send fails
        # with a reset and the close frame is never read; the socket is closed either way.
        with pytest.raises(ConnectionClosed) as info:
            await c.send(json.dumps({"type": "ping", "pad": "x" * (2 << 20)}))
            await c.recv(10)
        rcvd = info.value.rcvd
        assert rcvd is None or rcvd.code == 1009, rcvd
        again = await Client.open(stack.a)  # the gateway itself is fine
        try:
            await again.send({"type": "ping"})
            assert await again.recv() == {"type": "pong"}
        finally:
            await again.close()
    finally:
        await c.close()


async def test_cancel_frees_blocks_and_is_idempotent(stack: Stack) -> None:
    baseline = await wait_blocks_free(stack, stack.worker_stats()["blocks_total"], 20)
    c = await Client.open(stack.a)
    other = await Client.open(stack.b)
    try:
        started = await start(c, "Tell me a very long story.", "long", **LONG)
        sid, token = started["stream_id"], started["resume_token"]
        await c.recv_until(lambda f: f.get("seq", 0) >= 5)
        # the worker publishes its stats once a second: wait for a snapshot taken mid-stream
        deadline = time.monotonic() + 10
        busy = stack.worker_stats()
        while busy["blocks_free"] >= baseline["blocks_free"] and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            busy = stack.worker_stats()
        assert busy["blocks_free"] < baseline["blocks_free"], busy
        # another socket needs the resume token
        await other.send({"type": "cancel", "stream_id": sid})
        assert (await other.recv())["code"] == "forbidden"
        await c.send({"type": "cancel", "stream_id": sid})
        frames = await c.recv_until(is_done(sid), 30)
        ack = [f for f in frames if f["type"] == "cancelled"]
        expected = {"type": "cancelled", "stream_id": sid, "state": "cancelling"}
        assert ack == [{**expected, "finish_reason": None}]
        done = frames[-1]
        assert done["type"] == "done" and done["finish_reason"] == "cancelled"
        tokens = [f["seq"] for f in frames if f["type"] == "token"]
        assert tokens == list(range(tokens[0], done["seq"]))
        await wait_blocks_free(stack, baseline["blocks_free"])
        # cancelling again: a clear answer, from this socket or with the token
        await c.send({"type": "cancel", "stream_id": sid})
        again = await c.recv()
        assert again == {**expected, "state": "finished", "finish_reason": "cancelled"}
        await other.send({"type": "cancel", "stream_id": sid, "resume_token": token})
        assert (await other.recv())["state"] == "finished"
        await other.send({"type": "cancel", "stream_id": sid, "resume_token": "nope"})
        assert (await other.recv())["code"] == "forbidden"
    finally:
        await c.close()
        await other.close()


async def test_cancel_from_another_socket_with_the_token(stack: Stack) -> None:
    c = await Client.open(stack.a)
    other = await Client.open(stack.b)
    try:
        started = await start(c, "Write a poem about rain.", "long2", **LONG)
        sid = started["stream_id"]
        await c.recv_until(lambda f: f.get("seq", 0) >= 2)
        await other.send(
            {"type": "cancel", "stream_id": sid, "resume_token": started["resume_token"]}
        )
        assert (await other.recv())["state"] == "cancelling"
        frames = await c.recv_until(is_done(sid), 30)
        assert frames[-1]["finish_reason"] == "cancelled"
    finally:
        await c.close()
        await other.close()


async def test_resume_errors(stack: Stack) -> None:
    c = await Client.open(stack.a)
    try:
        started = await start(c, "Hi there", "s", max_tokens=4, temperature=0)
        sid, token = started["stream_id"], started["resume_token"]
        done = (await c.recv_until(is_done(sid)))[-1]
        await c.send({"type": "resume", "stream_id": sid, "resume_token": "wrong" * 8})
        assert (await c.recv())["code"] == "forbidden"
        await c.send({"type": "resume", "stream_id": sid, "resume_token": token, "after": 999})
        err = await c.recv()
        assert err["code"] == "bad_request" and err["stream_id"] == sid
        # resuming a finished stream replays it, on any gateway
        d = await Client.open(stack.b)
        await d.send({"type": "resume", "stream_id": sid, "resume_token": token, "after": 0})
        frames = await d.recv_until(is_done(sid))
        assert frames[0] == {"type": "resumed", "stream_id": sid, "after": 0}
        assert frames[-1] == done
        await d.close()
    finally:
        await c.close()


async def _abandon(stack: Stack, addr: str, rid: str) -> tuple[str, str, int]:
    c = await Client.open(addr)
    started = await start(c, "Describe the sea at length.", rid, **LONG)
    frames = await c.recv_until(lambda f: f.get("seq", 0) >= 3)
    await c.close()
    return started["stream_id"], started["resume_token"], frames[-1]["seq"]


async def test_detach_timeout_expires_an_abandoned_stream(stack: Stack) -> None:
    sid, token, _ = await _abandon(stack, stack.b, "gone")  # gateway b: --detach-timeout 3
    await asyncio.sleep(5.5)
    c = await Client.open(stack.a)
    try:
        await c.send({"type": "resume", "stream_id": sid, "resume_token": token, "after": 0})
        frames = await c.recv_until(is_done(sid), 30)
        done = frames[-1]
        assert done["type"] == "done" and done["finish_reason"] == "expired"
        assert [f["seq"] for f in frames if f["type"] == "token"] == list(range(1, done["seq"]))
    finally:
        await c.close()


async def test_resume_within_the_detach_timeout_continues(stack: Stack) -> None:
    sid, token, seen = await _abandon(stack, stack.b, "back")
    await asyncio.sleep(1.5)
    c = await Client.open(stack.b)
    try:
        await c.send({"type": "resume", "stream_id": sid, "resume_token": token, "after": seen})
        frames = await c.recv_until(lambda f: f.get("seq", 0) >= seen + 5, 30)
        assert frames[0]["type"] == "resumed"
        assert [f["seq"] for f in frames[1:]] == list(range(seen + 1, seen + 6))
        await asyncio.sleep(3.5)  # past the timeout while attached: still running
        await c.send({"type": "cancel", "stream_id": sid})
        frames = await c.recv_until(is_done(sid), 30)
        assert frames[-1]["finish_reason"] == "cancelled"
    finally:
        await c.close()


async def test_stream_started_on_one_gateway_resumes_on_the_other(stack: Stack) -> None:
    c = await Client.open(stack.a)
    started = await start(c, "List three fruits.", "x", max_tokens=24, temperature=0)
    sid, token = started["stream_id"], started["resume_token"]
    first = await c.recv_until(lambda f: f.get("seq", 0) >= 2)
    c.cut()
    d = await Client.open(stack.b)
    try:
        await d.send({"type": "resume", "stream_id": sid, "resume_token": token, "after": 2})
        frames = await d.recv_until(is_done(sid))
        assert frames[0]["type"] == "resumed"
        seqs = [f["seq"] for f in first if f["type"] == "token"] + [
            f["seq"] for f in frames if f["type"] == "token"
        ]
        assert seqs == list(range(1, frames[-1]["seq"]))
    finally:
        await d.close()
