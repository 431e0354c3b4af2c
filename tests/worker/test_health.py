"""The worker's health port (worker/health.py): /healthz follows the loop, Redis and drain;
/metrics is the worker's own snapshot under the gateway's metric names."""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.procs import free_port, start_worker
from tests.worker.test_stats import IdleEngine
from tokenrelay.core.metrics import HISTOGRAMS, NS, WORKER_COUNTERS, WORKER_GAUGES
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.core.wire.telemetry import BUCKETS, Hist
from tokenrelay.worker.health import LOOP_STALE_S, STEP_LIMIT_S, HealthServer, start_health
from tokenrelay.worker.main import Worker
from tokenrelay.worker.settings import WorkerSettings
from tokenrelay.worker.store import WorkerStore

PREFIX = "whealth:"
WID = "health-test-worker"


def get(port: int, path: str, method: str = "GET") -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read()
    finally:
        conn.close()


def healthz(port: int) -> tuple[int, dict[str, Any]]:
    status, ctype, body = get(port, "/healthz")
    assert ctype == "application/json"
    return status, json.loads(body)


def wait_for(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


class Idle(threading.Thread):
    """A thread that uses no CPU (a loop stuck on a lock), or one that spins (a long step)."""

    def __init__(self, *, spin: bool = False) -> None:
        super().__init__(daemon=True)
        self.spin, self.done = spin, threading.Event()

    def run(self) -> None:
        while self.spin and not self.done.is_set():
            sum(range(1000))
        self.done.wait()


def make_worker(url: str) -> Worker:
    worker_store = WorkerStore(url, WID, prefix=PREFIX)
    worker_store.ensure_group()
    w = Worker(IdleEngine(), worker_store, detach_timeout=30, stream_ttl=60)
    w._publish_stats()
    return w


@pytest.fixture
def server() -> Iterator[HealthServer]:
    hs = HealthServer(WID).start()  # port 0: any free one
    try:
        yield hs
    finally:
        hs.close()


@pytest.fixture
def worker(redis_server: EmbeddedRedis) -> Iterator[Worker]:
    w = make_worker(redis_server.url)
    try:
        yield w
    finally:
        w.store.close()


def test_loading_then_alive_then_draining_then_stopping(
    server: HealthServer, worker: Worker
) -> None:
    assert healthz(server.port) == (
        503,
        {"status": "unavailable", "reason": "loading", "worker_id": WID},
    )
    server.attach(worker)  # the loop would run in this thread; its snapshot is fresh
    status, body = healthz(server.port)
    assert status == 200 and body["status"] == "ok" and body["redis"] is True
    assert 0 <= body["loop_age_s"] < 1
    worker.drain(30)
    assert healthz(server.port)[1]["reason"] == "draining"
    worker.stop()
    assert healthz(server.port)[0] == 503 and healthz(server.port)[1]["reason"] == "stopping"


def test_a_loop_that_stops_iterating_is_stalled_unless_its_step_uses_cpu(
    server: HealthServer, worker: Worker
) -> None:
    idle, busy = Idle(), Idle(spin=True)
    idle.start()
    busy.start()
    try:
        worker._stats_at -= LOOP_STALE_S + 1  # no iteration ended for 6 s
        server.attach(worker, idle)  # ... and the loop's thread waits on something
        status, body = healthz(server.port)
        assert (status, body["reason"]) == (503, "stalled") and body["loop_age_s"] > LOOP_STALE_S
        server.attach(worker, busy)  # ... or is in a long step that still computes
        assert healthz(server.port)[0] == 200
        worker._stats_at -= STEP_LIMIT_S  # but no step is that long
        assert healthz(server.port)[1]["reason"] == "stalled"
    finally:
        idle.done.set()
        busy.done.set()


def test_redis_down_is_unhealthy_and_back_is_healthy(server: HealthServer, tmp_path: Path) -> None:
    """A real outage: the worker's loop runs against its own redis-server, stopped and started."""
    redis = EmbeddedRedis(tmp_path / "redis").start()
    worker = make_worker(redis.url)
    worker.max_seqs = 4  # idle iterations wait on the request stream, as a worker's do
    loop = threading.Thread(target=worker.run, name="health-loop")
    loop.start()
    server.attach(worker, loop)
    try:
        wait_for(lambda: healthz(server.port)[0] == 200)
        redis.stop()
        wait_for(lambda: healthz(server.port)[1]["reason"] == "redis_unreachable")
        assert healthz(server.port)[1]["redis"] is False
        redis.start()
        wait_for(lambda: healthz(server.port)[0] == 200, timeout=15)
    finally:
        worker.stop()
        loop.join(10)
        worker.store.close()
        redis.cleanup()
    assert not loop.is_alive()
    assert healthz(server.port)[1]["reason"] == "stopping"


def families(port: int) -> dict[str, Any]:
    status, ctype, body = get(port, "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def sample(fams: dict[str, Any], family: str, name: str | None = None, **labels: str) -> float:
    (value,) = [
        s.value
        for s in fams[family].samples
        if s.name == (name or family) and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return float(value)


def test_metrics_are_the_snapshot_under_the_gateway_names(
    server: HealthServer, worker: Worker
) -> None:
    loading = families(server.port)
    assert sample(loading, NS + "worker_ready", worker_id=WID) == 0
    assert NS + "generated_tokens" not in loading  # no snapshot yet
    assert "process_resident_memory_bytes" in loading
    server.attach(worker)
    ttft = Hist(BUCKETS["ttft"])
    ttft.observe(0.3)
    engine = {"running": 2, "waiting": 1, "blocks_free": 10, "blocks_total": 16}
    worker.snapshot = WorkerStats(
        worker_id=WID,
        active_streams=3,
        counters={"requests": 5, "stop": 2, "cancelled": 1},
        engine={**engine, "generated_tokens": 42, "num_steps": 7},
        hist={"ttft": ttft.to_json()},
    )
    fams = families(server.port)
    names = {NS + n for n in [*WORKER_GAUGES, *WORKER_COUNTERS]}
    names |= {NS + n for n, _ in HISTOGRAMS.values()}
    assert names <= set(fams)  # every per-worker family of the gateway's /metrics
    assert fams[NS + "generated_tokens"].type == "counter"
    assert sample(fams, NS + "generated_tokens", NS + "generated_tokens_total", worker_id=WID) == 42
    assert sample(fams, NS + "streams_active", worker_id=WID) == 3
    assert sample(fams, NS + "sequences_running", worker_id=WID) == 2
    assert sample(fams, NS + "kv_blocks_used", worker_id=WID) == 6
    assert sample(fams, NS + "requests_started", NS + "requests_started_total", worker_id=WID) == 5
    finished = NS + "requests_finished"
    assert sample(fams, finished, finished + "_total", worker_id=WID, finish_reason="stop") == 2
    hist = NS + "time_to_first_token_seconds"
    assert fams[hist].type == "histogram"
    assert sample(fams, hist, hist + "_count", worker_id=WID) == 1
    assert sample(fams, hist, hist + "_bucket", worker_id=WID, le="0.5") == 1
    assert sample(fams, hist, hist + "_bucket", worker_id=WID, le="0.25") == 0
    assert sample(fams, NS + "queue_wait_seconds", NS + "queue_wait_seconds_count") == 0
    assert sample(fams, NS + "worker_ready", worker_id=WID) == 1
    assert sample(fams, NS + "redis_up", worker_id=WID) == 1
    assert 0 <= sample(fams, NS + "worker_loop_age_seconds", worker_id=WID) < 5
    assert sample(fams, NS + "worker_draining", worker_id=WID) == 0


def test_other_paths_methods_and_garbage_do_no_harm(server: HealthServer, worker: Worker) -> None:
    server.attach(worker)
    assert get(server.port, "/")[0] == 404
    assert get(server.port, "/healthz/../metrics")[0] == 404
    assert get(server.port, "/metrics?name[]=x")[0] == 200
    status, _, body = get(server.port, "/healthz", "HEAD")
    assert status == 200 and body == b""
    assert get(server.port, "/healthz", "POST")[0] == 501
    for junk in (b"\x00\xff garbage\r\n\r\n", b"GET /" + b"x" * 70_000 + b" HTTP/1.1\r\n\r\n", b""):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            s.recv(1024)  # an error status line, or nothing
    worker.snapshot = "not a snapshot"  # type: ignore[assignment]  # a broken render: a 500 ...
    assert get(server.port, "/metrics")[0] == 500
    worker._publish_stats()
    assert healthz(server.port)[0] == 200  # ... and the port still answers


def test_start_health_is_off_by_default_and_names_a_busy_port() -> None:
    url = "redis://127.0.0.1:1"
    assert start_health(WorkerSettings(url, worker_id=WID)) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"--health-port {port}"):
            start_health(WorkerSettings(url, worker_id=WID, health_port=port))
    with pytest.raises(ValueError, match="not a TCP port"):
        WorkerSettings.from_args(argparse.Namespace(redis_url=url, health_port=70000))


@pytest.mark.slow
def test_tokenrelay_worker_serves_healthz_once_ready(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    port = free_port()
    proc = start_worker(redis_server.url, "whealth-e2e:", tmp_path, "--health-port", str(port))
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not seen or seen[-1] != "ok":
            assert proc.alive(), proc.log_text()[-3000:]
            assert time.monotonic() < deadline, proc.log_text()[-3000:]
            try:
                seen.append(healthz(port)[1]["reason"])
            except OSError:
                pass  # not listening yet (Python is still importing)
            time.sleep(0.1)
        assert set(seen) == {"loading", "ok"}  # the port opens before the model loads
        wid = json.loads(get(port, "/healthz")[2])["worker_id"]
        assert sample(families(port), NS + "worker_ready", worker_id=wid) == 1
    finally:
        assert proc.stop() == 0
