"""Chaos over gRPC: clients keep dropping their calls and resuming on new ones, and lose nothing.

The chaos of tests/e2e/test_chaos.py (its prompts, reference and checks, as they are)
against two gateways serving gRPC (``--grpc-port``) beside the session's engine worker:
every client starts its stream on a ``Chat`` call to gateway ``a``, drops it 1 to 3 times
at random points (the call cancelled, or its channel closed under it) and resumes on a new
call to either gateway. Each assembled text must equal the uninterrupted greedy text for
its prompt (streamed meanwhile over a WebSocket that never drops), with seqs 1..n-1.
Then a gateway's drain as a gRPC client sees it.

TOKENRELAY_GRPC_CHAOS_STREAMS / _TOKENS resize it (default 16 x 32: CPU inference).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tests.e2e.test_chaos import Channel, chaos_client, check_assembled, reference
from tests.gateway.grpc.client import GrpcClient, generate, pb2
from tests.gateway.procs import Proc, free_port, start_gateway, stop_all, wait_ready
from tests.gateway.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

STREAMS = int(os.environ.get("TOKENRELAY_GRPC_CHAOS_STREAMS", "16"))
TOKENS = int(os.environ.get("TOKENRELAY_GRPC_CHAOS_TOKENS", "32"))


@dataclass
class GrpcGateway:
    proc: Proc
    http: str  # host:port of its HTTP/WebSocket side
    grpc: str  # host:port of its gRPC side


def start_grpc_gateway(stack: Stack, logs: Path, *extra: str) -> GrpcGateway:
    port = free_port()
    url = stack.redis.url
    proc, http = start_gateway(url, stack.prefix, logs, "--grpc-port", str(port), *extra)
    return GrpcGateway(proc, http, f"127.0.0.1:{port}")


@dataclass
class Pair:
    a: str  # gRPC addresses: clients start on a, resume on either
    b: str
    gw_a: GrpcGateway


@pytest.fixture(scope="module")
def pair(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("grpc-chaos-logs")
    a = start_grpc_gateway(stack, logs)
    b = start_grpc_gateway(stack, logs)
    try:
        wait_ready(a.http, a.proc, 120)
        wait_ready(b.http, b.proc, 120)
        yield Pair(a.grpc, b.grpc, a)
    finally:
        stop_all([a.proc, b.proc])


GRPC = Channel(
    open=GrpcClient.open,
    generate=lambda text, rid, p: generate(text, rid, **p),
    resume=lambda sid, token, after: pb2.ClientFrame(
        resume=pb2.Resume(stream_id=sid, resume_token=token, after=after)
    ),
)


async def test_grpc_chaos_drops_and_resumes(stack: Stack, pair: Pair) -> None:
    rng = random.Random(2323)
    seeds = [rng.randrange(2**32) for _ in range(STREAMS)]
    ref_task = asyncio.create_task(reference(stack.a, STREAMS, TOKENS))
    clients = (chaos_client(pair, i, random.Random(seeds[i]), TOKENS, GRPC) for i in range(STREAMS))
    chaos = await asyncio.wait_for(asyncio.gather(*clients), 900)
    check_assembled(chaos, await asyncio.wait_for(ref_task, 300), TOKENS)


async def test_a_draining_gateway_tells_its_grpc_calls(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SIGTERM: a ``shutting_down`` notice, the running stream finishes, then ``UNAVAILABLE``."""
    gw = start_grpc_gateway(stack, tmp_path_factory.mktemp("grpc-drain-logs"))
    try:
        wait_ready(gw.http, gw.proc, 120)
        c = await GrpcClient.open(gw.grpc)
        await c.send(generate("Tell me about owls.", "d1", max_tokens=24, temperature=0.0,
                              ignore_eos=True))  # fmt: skip
        frames = await c.recv_until(lambda f: f["type"] == "started", 120)
        gw.proc.terminate()
        frames = await c.recv_until(lambda f: f["type"] == "done", 120)
        kinds = [f["type"] for f in frames]
        assert "notice" in kinds, kinds
        notice = frames[kinds.index("notice")]
        assert notice["code"] == "shutting_down" and notice["drain_s"] > 0
        done = frames[-1]
        assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 24
        seqs = [f["seq"] for f in frames if f["type"] == "token"]
        assert seqs == list(range(1, done["seq"]))  # the drain held nothing back
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.recv(60)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await c.close()
        deadline = time.monotonic() + 30
        while gw.proc.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert gw.proc.wait_stopped(30) == 0, gw.proc.log_text()[-3000:]
    finally:
        gw.proc.stop(30)
