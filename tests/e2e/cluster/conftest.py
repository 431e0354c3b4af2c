"""A fleet on a real 3-master Redis Cluster: two engine workers and two gateways.

Every process runs with ``--redis-cluster`` against the session's cluster
(tests/conftest.py, skipped where no redis-server >= 7 is installed).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from tests.gateway.procs import Proc, start_gateway, start_worker, stop_all, wait_ready
from tokenrelay.core.redis.local_cluster import LocalCluster
from tokenrelay.core.wire.keys import Keys

CLUSTER = "--redis-cluster"


@dataclass
class ClusterFleet:
    """Two workers and two gateways (``a``, ``b``) of one fleet on a Redis Cluster."""

    cluster: LocalCluster
    prefix: str
    workers: list[Proc]
    gateways: list[Proc]
    a: str
    b: str

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster.from_url(self.cluster.url)

    def worker_of(self, stream_id: str) -> str:
        raw = self.client().hget(Keys(self.prefix).meta(stream_id), "w")
        return raw.decode() if isinstance(raw, bytes) else ""


def start_fleet(
    cluster: LocalCluster, prefix: str, logs: Path, workers: int = 2, gateways: int = 2
) -> tuple[list[Proc], list[tuple[Proc, str]]]:
    """Engine workers ``cw0``.. and gateways on ``cluster`` (not waited for)."""
    ws = [
        start_worker(cluster.url, prefix, logs, CLUSTER, "--worker-id", f"cw{i}")
        for i in range(workers)
    ]
    gws = [start_gateway(cluster.url, prefix, logs, CLUSTER) for _ in range(gateways)]
    return ws, gws


@pytest.fixture(scope="module")
def fleet(
    redis_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterFleet]:
    logs = tmp_path_factory.mktemp("cluster-fleet-logs")
    prefix = "cl:"
    workers, gws = start_fleet(redis_cluster, prefix, logs)
    procs = [*workers, *(p for p, _ in gws)]
    try:
        for proc, addr in gws:
            wait_ready(addr, proc, 300)
        yield ClusterFleet(
            redis_cluster, prefix, workers, [p for p, _ in gws], gws[0][1], gws[1][1]
        )
    finally:
        stop_all(procs)
