"""The worker's own HTTP port: ``GET /healthz`` and ``GET /metrics`` (``--health-port``).

A worker serves no clients, so a health check (docker/compose.yaml, a Kubernetes probe)
or Prometheus asks it here: a stdlib ``ThreadingHTTPServer`` in daemon threads, off
unless ``--health-port`` is set (``tokenrelay serve`` leaves it off: its gateway has
``/readyz`` and ``/metrics``), bound to ``--health-host``, loopback by default.

The port opens before the model loads, so a port in use fails at once rather than after
the load, and ``/healthz`` answers 503 ``loading`` until the worker is built. Then it
answers 200 while

- the worker is neither draining nor stopping (503 ``draining`` / ``stopping``);
- its loop reaches Redis (the loop's ``RedisHealth``; 503 ``redis_unreachable``);
- its loop is alive: it ended an iteration within :data:`LOOP_STALE_S` (an iteration
  takes a stats snapshot at least every 0.5 s, worker/main.py), or it is inside a long
  step whose thread still uses CPU (its CPU time moves during a :data:`PROBE_S` look,
  read from ``/proc``), for at most :data:`STEP_LIMIT_S` (503 ``stalled``).

``/metrics`` renders the loop's latest stats snapshot (the one the heartbeat publishes,
at most ~0.5 s old) with the families of core/metrics.py, the same names and
``worker_id`` label as a gateway's ``/metrics``, plus ``tokenrelay_worker_ready``,
``tokenrelay_redis_up``, ``tokenrelay_worker_loop_age_seconds`` and the process'
``process_*`` figures. Every other path is 404; a request the handler cannot answer
gets a 500 and never reaches the worker's loop.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import TCPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from tokenrelay.core.metrics import LABEL, NS, histogram_families, worker_families

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from tokenrelay.worker.main import Worker
    from tokenrelay.worker.settings import WorkerSettings

log = logging.getLogger("tokenrelay.worker")

LOOP_STALE_S = 5.0  # no iteration for longer: alive only if the loop's thread uses CPU
STEP_LIMIT_S = 120.0  # no iteration for longer: stalled, CPU or not
PROBE_S = 0.2  # how long /healthz watches the loop's CPU time when the loop is stale
REQUEST_TIMEOUT_S = 10.0  # a client that sends nothing for this long is dropped
TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class Health:
    """What ``/healthz`` says: ``reason`` is ``ok`` or why the worker is not healthy."""

    reason: str
    loop_age: float | None = None  # seconds since the loop last ended an iteration
    redis: bool | None = None  # whether the loop reaches Redis

    @property
    def ok(self) -> bool:
        return self.reason == "ok"

    def body(self, worker_id: str) -> bytes:
        out: dict[str, Any] = {
            "status": "ok" if self.ok else "unavailable",
            "reason": self.reason,
            "worker_id": worker_id,
        }
        if self.loop_age is not None:
            out["loop_age_s"] = round(self.loop_age, 3)
        if self.redis is not None:
            out["redis"] = self.redis
        return json.dumps(out).encode() + b"\n"


def thread_cpu_seconds(native_id: int | None) -> float | None:
    """CPU time a thread of this process has used (Linux ``/proc``), None if unknown."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) "
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


def progressing(thread: threading.Thread | None, probe: float = PROBE_S) -> bool:
    """Whether ``thread`` is alive and uses CPU while we watch it for ``probe`` seconds."""
    if thread is None or not thread.is_alive():
        return False
    before = thread_cpu_seconds(thread.native_id)
    if before is None:
        return False
    time.sleep(probe)
    after = thread_cpu_seconds(thread.native_id)
    return after is not None and after > before


class HealthServer:
    """The health port of one worker process; :meth:`attach` the worker once it is built."""

    def __init__(self, worker_id: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.worker_id = worker_id
        self.worker: Worker | None = None
        self.loop_thread: threading.Thread | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        ProcessCollector(registry=self.registry)
        self._httpd = _Server((host, port), self)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="health-port", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()

    def attach(self, worker: Worker, loop_thread: threading.Thread | None = None) -> None:
        """Answer for ``worker``, whose loop runs in ``loop_thread`` (default: this thread)."""
        self.loop_thread = loop_thread or threading.current_thread()
        self.worker = worker

    def check(self) -> Health:
        w = self.worker
        if w is None:
            return Health("loading")
        if w.stopping.is_set():
            return Health("stopping")
        if w.draining.is_set():
            return Health("draining")
        age = max(0.0, time.monotonic() - w._stats_at)  # the loop's last snapshot
        redis = w.health.up
        if not redis:
            return Health("redis_unreachable", age, redis)
        if age > LOOP_STALE_S and (age > STEP_LIMIT_S or not progressing(self.loop_thread)):
            return Health("stalled", age, redis)
        return Health("ok", age, redis)

    def answer(self, path: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for a GET of ``path``."""
        if path == "/healthz":
            health = self.check()
            return (200 if health.ok else 503), "application/json", health.body(self.worker_id)
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, bytes(generate_latest(self.registry))
        return 404, TEXT, b"not found: /healthz and /metrics only\n"


def start_health(settings: WorkerSettings) -> HealthServer | None:
    """Open ``--health-port`` on ``--health-host`` (None when the port is 0: off).

    Raises ``ValueError`` with one line when the port cannot be opened.
    """
    port, host = settings.health_port, settings.health_host
    if port == 0:
        return None
    try:
        server = HealthServer(settings.worker_id, host, port)
    except OSError as exc:
        raise ValueError(f"--health-port {port}: cannot listen on {host}: {exc}") from None
    log.info("health port listening", extra={"host": host, "port": port})
    return server.start()


class _Collector(Collector):
    def __init__(self, server: HealthServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        wid, worker = self.server.worker_id, self.server.worker
        health = self.server.check()
        yield _gauge("worker_ready", "1 while this worker's /healthz answers 200.", wid, health.ok)
        if worker is None:
            return
        if health.redis is not None:
            yield _gauge("redis_up", "1 while the worker's loop reaches Redis.", wid, health.redis)
        age = max(0.0, time.monotonic() - worker._stats_at)
        doc = "Seconds since the worker's loop last ended an iteration."
        yield _gauge("worker_loop_age_seconds", doc, wid, age)
        mine = {wid: worker.snapshot}
        yield from worker_families(mine)
        yield from histogram_families(mine, per_worker=True)


def _gauge(name: str, doc: str, worker_id: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(NS + name, doc, labels=[LABEL])
    family.add_metric([worker_id], float(value))
    return family


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], health: HealthServer) -> None:
        self.health = health
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        TCPServer.server_bind(self)  # not HTTPServer's: no reverse DNS lookup of the host
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("health port: connection from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "tokenrelay-worker"
    sys_version = ""
    timeout = REQUEST_TIMEOUT_S

    def do_GET(self) -> None:
        self._reply(body=True)

    def do_HEAD(self) -> None:
        self._reply(body=False)

    def _reply(self, *, body: bool) -> None:
        try:
            status, ctype, payload = self.server.health.answer(urlsplit(self.path).path)
        except Exception:
            log.exception("health port: %s failed", self.path[:100])
            status, ctype, payload = 500, TEXT, b"internal error\n"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # one line per probe: too many
        log.debug("health port: " + format, *args)
