"""The session's stack: an engine worker and two gateways on the session's Redis.

A fixture of the whole suite (tests/conftest.py lists this module in ``pytest_plugins``):
the gateway tests and the end-to-end suites of tests/e2e/ share one stack per run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.gateway.procs import Proc, start_gateway, start_worker, stop_all, wait_ready
from tokenrelay.core.redis.embedded import EmbeddedRedis


@dataclass
class Stack:
    """Worker + two gateways on the session's Redis (key prefix ``e2e:``).

    Gateway ``a`` uses the default detach timeout; gateway ``b`` a 3-second one.
    """

    redis: EmbeddedRedis
    prefix: str
    worker: Proc
    worker_id: str
    gw_a: Proc
    a: str
    gw_b: Proc
    b: str

    def worker_stats(self) -> dict[str, Any]:
        raw = self.redis.client().hget(f"{self.prefix}w:{self.worker_id}", "stats")
        return dict(json.loads(raw)) if raw else {}


@pytest.fixture(scope="session")
def stack(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("e2e-logs")
    prefix, wid = "e2e:", "e2e-worker"
    url = redis_server.url
    worker = start_worker(url, prefix, logs, "--worker-id", wid, "--max-num-seqs", "128")
    gw_a, a = start_gateway(url, prefix, logs)
    gw_b, b = start_gateway(url, prefix, logs, "--detach-timeout", "3")
    procs = [worker, gw_a, gw_b]
    try:
        wait_ready(a, gw_a, 300)
        wait_ready(b, gw_b, 60)
        yield Stack(redis_server, prefix, worker, wid, gw_a, a, gw_b, b)
    finally:
        stop_all(procs)
