"""A shard's master killed mid-stream and restarted: ``unavailable``, then a full resume.

On a cluster of its own (every node ``appendonly yes``, ``appendfsync always``), one
worker and one gateway stream a long greedy response. The master holding that stream's
slot is SIGKILLed: the client gets an ``error`` frame with code ``unavailable``; the
worker keeps the events Redis did not confirm. The master restarts from its AOF, the
client resumes from the last seq it saw, and the assembled text equals the same prompt's
uninterrupted text, with seqs 1..n-1: nothing lost, nothing doubled. A stream on another
shard gets no error and no pause: its tokens keep coming while the master is down (the
worker writes each master's streams apart, worker/outage.py), and it completes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis

from tests.e2e.cluster.conftest import start_fleet
from tests.gateway.procs import Client, generate_frame, stop_all, wait_ready
from tokenrelay.core.redis.local_cluster import LocalCluster
from tokenrelay.core.wire.keys import Keys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PREFIX = "kill:"
TOKENS = 96
PROMPT = "Write a long story about a lighthouse keeper and a storm."
PARAMS = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}


async def _stream(addr: str, rid: str) -> tuple[Client, str, str]:
    c = await Client.open(addr)
    await c.send(generate_frame(PROMPT, rid, **PARAMS))
    started = (await c.recv_until(lambda f: f["type"] == "started", 120))[-1]
    return c, started["stream_id"], started["resume_token"]


async def _rest(c: Client, seqs: list[int], text: list[str]) -> dict[str, Any]:
    """Token frames into ``seqs``/``text`` up to the ``done`` frame (returned)."""
    while True:
        f = await c.recv(120)
        if f["type"] == "token":
            seqs.append(f["seq"])
            text.append(f["text"])
        elif f["type"] == "done":
            return f
        elif f["type"] not in ("resumed", "notice"):  # notices: a worker (un)ready
            raise AssertionError(f)


async def test_master_killed_mid_stream_then_resumed(
    fresh_redis_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cluster = fresh_redis_cluster
    workers, gws = start_fleet(
        cluster, PREFIX, tmp_path_factory.mktemp("kill-logs"), workers=1, gateways=1
    )
    (gw, addr), procs = gws[0], [*workers, gws[0][0]]
    try:
        wait_ready(addr, gw, 300)
        ref, _, _ = await _stream(addr, "ref")
        ref_text: list[str] = []
        await _rest(ref, [], ref_text)
        await ref.close()

        client, keys = redis.RedisCluster.from_url(cluster.url), Keys(PREFIX, cluster=True)

        def master(stream_id: str) -> int:
            return cluster.ports.index(int(client.get_node_from_key(keys.meta(stream_id)).port))

        c, sid, token = await _stream(addr, "victim")
        node = master(sid)
        while True:  # a bystander: a stream on another shard, which must see no error
            b, bsid, _ = await _stream(addr, "bystander")
            if master(bsid) != node:
                break
            await b.send({"type": "cancel", "stream_id": bsid})
            await b.close()
        bseqs: list[int] = []
        btext: list[str] = []
        bystander = asyncio.create_task(_rest(b, bseqs, btext))
        seqs: list[int] = []
        text: list[str] = []
        while len(seqs) < 8:
            f = await c.recv(60)
            assert f["type"] == "token", f
            seqs.append(f["seq"])
            text.append(f["text"])
        cluster.kill(node)
        # the client hears of the outage (the tokens already on their way come first)
        while True:
            f = await c.recv(60)
            if f["type"] == "error":
                assert f["code"] == "unavailable", f
                break
            assert f["type"] in ("token", "notice"), f
            if f["type"] == "token":
                seqs.append(f["seq"])
                text.append(f["text"])
        await c.close()
        # the bystander's shard is up: its tokens keep coming while the master is down
        during = len(bseqs)
        deadline = time.monotonic() + 30
        while len(bseqs) < during + 4 and not bystander.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert len(bseqs) >= during + 4 or bystander.done(), (during, len(bseqs))
        cluster.restart(node)

        done = await _resume(addr, sid, token, seqs, text)
        assert seqs == list(range(1, done["seq"])), "gap or duplicate"
        assert done["finish_reason"] == "length", done
        assert done["usage"]["completion_tokens"] == TOKENS
        assert "".join(text) == "".join(ref_text)
        bdone = await asyncio.wait_for(bystander, 120)  # no error frame on the way
        assert bseqs == list(range(1, bdone["seq"])) and "".join(btext) == "".join(ref_text)
        await b.close()
        assert workers[0].alive() and gw.alive()
    finally:
        stop_all(procs)


async def _resume(
    addr: str, sid: str, token: str, seqs: list[int], text: list[str]
) -> dict[str, Any]:
    """Resume after the last seq seen until it works (the shard may still be rejoining)."""
    deadline = time.monotonic() + 60
    while True:
        c = await Client.open(addr)
        try:
            after = seqs[-1] if seqs else 0
            frame = {"type": "resume", "stream_id": sid, "resume_token": token, "after": after}
            await c.send(frame)
            first = await c.recv(30)
            if first["type"] == "error" and time.monotonic() < deadline:
                assert first["code"] == "unavailable", first
                await asyncio.sleep(0.5)
                continue
            assert first == {"type": "resumed", "stream_id": sid, "after": after}, first
            try:
                return await _rest(c, seqs, text)
            except AssertionError as exc:  # the outage may not be over for the feed yet
                got = exc.args[0] if exc.args else None
                if not (isinstance(got, dict) and got.get("code") == "unavailable"):
                    raise
        finally:
            await c.close()
