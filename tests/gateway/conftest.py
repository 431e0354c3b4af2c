"""Fixtures for the gateway suite: a stream log and a worker log on real Redis.

Each test gets its own key prefix on the session's redis-server, so tests never
see each other's streams, requests or workers. The session's worker and gateways
(``stack``) are in tests/gateway/stack.py, a fixture of the whole suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator

import pytest

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
