"""Chaos over a relay: clients drop and resume at random points, and lose nothing.

The chaos of tests/e2e/test_chaos.py (its helpers, as they are) against the session's
relay (``tokenrelay serve --upstream``, tests/worker/upstream/servers.py) and a second
gateway on the relay's Redis prefix: every client drops its socket 1 to 3 times (clean
closes and TCP cuts) and resumes on either gateway. Each assembled text must equal the
upstream's own uninterrupted greedy text for its prompt, with seqs 1..n-1.

TOKENRELAY_RELAY_CHAOS_STREAMS / _TOKENS resize it (default 12 x 24: CPU inference).
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.e2e.test_chaos import chaos_client, check_assembled, reference
from tests.gateway.procs import start_gateway, wait_ready
from tests.worker.upstream.servers import Server
from tokenrelay.core.redis.embedded import EmbeddedRedis

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STREAMS = int(os.environ.get("TOKENRELAY_RELAY_CHAOS_STREAMS", "12"))
TOKENS = int(os.environ.get("TOKENRELAY_RELAY_CHAOS_TOKENS", "24"))


@dataclass
class RelayGateways:
    a: str  # the relay's own gateway (serve --upstream)
    b: str  # a second gateway of the same fleet


@pytest.fixture
def gateways(
    relay: Server, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RelayGateways]:
    logs = tmp_path_factory.mktemp("relay-chaos-logs")
    proc, addr = start_gateway(redis_server.url, "relay:", logs)  # the relay fixture's prefix
    try:
        wait_ready(addr, proc, 60)
        yield RelayGateways(relay.addr, addr)
    finally:
        proc.stop(30)


async def test_chaos_over_the_relay_assembles_the_upstreams_text(
    upstream: Server, gateways: RelayGateways
) -> None:
    rng = random.Random(4321)
    seeds = [rng.randrange(2**32) for _ in range(STREAMS)]
    refs = await asyncio.wait_for(reference(upstream.addr, STREAMS, TOKENS), 600)
    clients = (chaos_client(gateways, i, random.Random(seeds[i]), TOKENS) for i in range(STREAMS))
    chaos = await asyncio.wait_for(asyncio.gather(*clients), 600)
    check_assembled(chaos, refs, TOKENS)
