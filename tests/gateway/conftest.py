"""Fixtures for the gateway suite: a stream log and a worker log on real Redis.

Each test gets its own key prefix on the session's redis-server, so tests never
see each other's streams, requests or workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.gateway.procs import Proc, start_gateway, start_worker, stop_all, wait_ready
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.gateway.streams.store import StreamStore
from tokenrelay.worker.store import WorkerStore


@pytest.fixture
def prefix() -> str:
    return f"t{secrets.token_hex(4)}:"


@contextlib.asynccontextmanager
async def open_slog(url: str, prefix: str, *, cluster: bool = False) -> AsyncIterator[StreamStore]:
    """A started stream store (a gateway's), closed on leaving; a hang on close says where."""
    log = StreamStore(url, prefix=prefix, stream_ttl=60, detach_timeout=30, cluster=cluster)
    await log.start()
    try:
        yield log
    finally:
        closing = asyncio.create_task(log.close())
        done, _ = await asyncio.wait([closing], timeout=20)
        if not done:  # say where it hangs: every task's stack
            for task in asyncio.all_tasks():
                print("--- task", task.get_name())
                task.print_stack(limit=12)
            raise AssertionError("StreamStore.close() hangs")


@contextlib.contextmanager
def open_wlog(url: str, prefix: str, *, cluster: bool = False) -> Iterator[WorkerStore]:
    """Worker ``w-test``'s store, its queues' group made and its heartbeat published."""
    log = WorkerStore(url, "w-test", prefix=prefix, cluster=cluster)
    log.ensure_group()
    log.heartbeat(WorkerStats())
    try:
        yield log
    finally:
        log.close()


@pytest.fixture
async def stream_store(redis_server: EmbeddedRedis, prefix: str) -> AsyncIterator[StreamStore]:
    async with open_slog(redis_server.url, prefix) as log:
        yield log


@pytest.fixture
def worker_store(redis_server: EmbeddedRedis, prefix: str) -> Iterator[WorkerStore]:
    with open_wlog(redis_server.url, prefix) as log:
        yield log


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
