"""The stats snapshot: taken by the worker's loop when its heartbeat asks for one."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.tools import Tool
from tokenrelay.worker.main import STATS_MAX_AGE, Heartbeat, Worker
from tokenrelay.worker.store import WorkerStore

PREFIX = "wstats:"


class IdleEngine:
    """An engine with nothing to do (the worker's loop runs without steps)."""

    def __init__(self) -> None:
        self.calls = 0

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: tuple[Tool, ...] = ()
    ) -> list[int]:
        raise ValueError("not used")

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> int:
        raise ValueError("not used")

    def abort(self, request_id: str) -> bool:
        return False

    def has_unfinished(self) -> bool:
        return False

    def unstarted_requests(self) -> list[str]:
        return []

    def step(self) -> list[Any]:
        return []

    def stats(self) -> dict[str, Any]:
        self.calls += 1
        return {"max_num_seqs": 4, "num_steps": self.calls}

    backend = "engine"

    def served_models(self) -> list[str] | None:
        return None

    def close(self) -> None:
        pass


@pytest.fixture
def worker(redis_server: EmbeddedRedis) -> Iterator[Worker]:
    worker_store = WorkerStore(redis_server.url, "stats-test-worker", prefix=PREFIX)
    worker_store.ensure_group()
    w = Worker(IdleEngine(), worker_store, detach_timeout=30, stream_ttl=60)
    w.max_seqs = 0  # no room: an iteration does not block on the request stream
    try:
        yield w
    finally:
        worker_store.close()


def test_the_loop_takes_a_snapshot_when_asked_or_when_it_is_old(worker: Worker) -> None:
    worker._iteration()  # none yet: taken
    first = worker.snapshot
    assert first.engine["num_steps"] >= 1
    worker._iteration()  # young, nobody asked: kept
    assert worker.snapshot is first
    worker._stats_wanted.set()  # a heartbeat asks
    worker._iteration()
    second = worker.snapshot
    assert second is not first and second.engine["num_steps"] > first.engine["num_steps"]
    assert not worker._stats_wanted.is_set() and worker._stats_taken.is_set()
    worker._stats_at -= STATS_MAX_AGE  # grown old
    worker._iteration()
    assert worker.snapshot is not second


def test_fresh_snapshot_waits_for_the_end_of_the_iteration(worker: Worker) -> None:
    worker._publish_stats()
    old = worker.snapshot
    assert worker.fresh_snapshot(0.05) is old  # no iteration ends: the last one
    got: list[Any] = []
    asking = threading.Thread(target=lambda: got.append(worker.fresh_snapshot(10)))
    asking.start()
    while not worker._stats_wanted.is_set():
        time.sleep(0.001)
    worker.counters["requests"] = 7
    worker._iteration()
    asking.join(10)
    assert got and got[0] is worker.snapshot and got[0].counters["requests"] == 7


def test_heartbeat_publishes_fresh_stats_and_stops_with_the_worker(
    worker: Worker, redis_server: EmbeddedRedis
) -> None:
    key = f"{PREFIX}w:{worker.worker_id}"
    client = redis_server.client()
    worker.max_seqs = 4  # idle iterations wait on the request stream, as a worker's do
    worker._publish_stats()
    loop = threading.Thread(target=worker.run)
    beat = Heartbeat(worker, redis_server.url, PREFIX)
    beat.start()
    loop.start()
    try:
        worker.counters["requests"] = 5
        deadline = time.monotonic() + 10
        published: dict[str, Any] = {}
        while published.get("requests") != 5 and time.monotonic() < deadline:
            time.sleep(0.05)
            raw = client.hget(key, "stats")
            published = json.loads(raw) if raw else {}
        assert published.get("requests") == 5
    finally:
        worker.stop()
        loop.join(10)
        beat.join(10)
    assert not loop.is_alive() and not beat.is_alive()
    assert not client.exists(key)  # the worker removed it; the heartbeat wrote no more
