"""Chaos on a Redis Cluster: two gateways, two workers, clients dropping and resuming.

The chaos of tests/e2e/test_chaos.py (its helpers, as they are) on a fleet whose
every process runs with ``--redis-cluster`` against three masters: each client drops
1 to 3 times and resumes on either gateway, and each assembled text must equal the
uninterrupted greedy text of its prompt with seqs 1..n-1. The streams' keys must have
landed on every master (one slot per stream), the requests on both workers.

TOKENRELAY_CLUSTER_CHAOS_STREAMS / _TOKENS resize it (default 24 x 32: CPU inference).
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from tests.e2e.cluster.conftest import ClusterFleet
from tests.e2e.test_chaos import Outcome, chaos_client, check_assembled, reference
from tokenrelay.core.wire.keys import Keys, slot_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STREAMS = int(os.environ.get("TOKENRELAY_CLUSTER_CHAOS_STREAMS", "24"))
TOKENS = int(os.environ.get("TOKENRELAY_CLUSTER_CHAOS_TOKENS", "32"))


async def test_chaos_on_a_cluster_assembles_every_text(fleet: ClusterFleet) -> None:
    rng = random.Random(2468)
    seeds = [rng.randrange(2**32) for _ in range(STREAMS)]
    refs = await asyncio.wait_for(reference(fleet.b, STREAMS, TOKENS), 600)
    clients = (chaos_client(fleet, i, random.Random(seeds[i]), TOKENS) for i in range(STREAMS))
    chaos: list[Outcome] = await asyncio.wait_for(asyncio.gather(*clients), 600)
    check_assembled(chaos, refs, TOKENS)


def test_streams_spread_over_every_master_and_both_workers(fleet: ClusterFleet) -> None:
    """After the chaos: each stream's keys share its slot, and the streams of this fleet
    sit on all three masters and were served by both workers."""
    keys = Keys(fleet.prefix, cluster=True)
    client = fleet.client()
    sids = {
        k.decode().split("{", 1)[1].rstrip("}")
        for k in client.scan_iter(match=f"{fleet.prefix}m:*", target_nodes=client.ALL_NODES)
    }
    assert len(sids) >= STREAMS
    for sid in sids:
        assert slot_of(keys.stream(sid)) == slot_of(keys.meta(sid)) == slot_of(keys.channel(sid))
    masters = {client.get_node_from_key(keys.meta(sid)).name for sid in sids}
    assert len(masters) == 3, masters
    assert {fleet.worker_of(sid) for sid in sids} == {"cw0", "cw1"}
