"""Real servers for the relay tests: an upstream tokenrelay, relays in front of it.

- ``upstream``: ``tokenrelay serve`` with the default model (an OpenAI-compatible
  server like any other) on the session's Redis under its own prefix, with a
  2-second detach timeout so that a request its client left stops soon;
- ``relay``: ``tokenrelay serve --upstream <upstream>/v1`` on the same Redis under
  another prefix: embedded gateway + a relay worker, no model;
- ``fault_relay``: ``tokenrelay gateway`` + ``tokenrelay worker --upstream`` whose
  upstream is a :class:`FaultProxy` in front of ``upstream`` (1.5 s chunk timeout,
  2 s detach timeout).

One of each per session: the upstream loads its model once. Fixtures of the whole suite
(tests/conftest.py lists this module in ``pytest_plugins``): the relay tests here and the
end-to-end suites of tests/e2e/ share them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.procs import Client, Proc, free_port, generate_frame, stop_all, wait_ready
from tests.worker.upstream.faultproxy import PASS, FaultProxy
from tokenrelay.core.redis.embedded import EmbeddedRedis

CHUNK_TIMEOUT = 1.5  # the fault relay's --upstream-timeout
DETACH_TIMEOUT = 2.0  # the fault relay gateway's (requests carry it to the worker)


@dataclass
class Server:
    proc: Proc
    addr: str  # host:port
    extra: list[Proc] | None = None

    @property
    def base(self) -> str:
        return f"http://{self.addr}/v1"

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels`` (from /metrics)."""
        text = httpx.get(f"http://{self.addr}/metrics", timeout=10).text
        total = 0.0
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def log_text(self) -> str:
        return "".join(p.log_text() for p in [self.proc, *(self.extra or [])])


def _serve(logs: Path, name: str, redis_url: str, prefix: str, *extra: str) -> Server:
    port = free_port()
    args = ["serve", "--redis-url", redis_url, "--redis-prefix", prefix, "--port", str(port)]
    return Server(Proc([*args, *extra], logs / f"{name}.log"), f"127.0.0.1:{port}")


@pytest.fixture(scope="session")
def upstream(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("upstream-logs")
    server = _serve(logs, "upstream", redis_server.url, "up:", "--device", "cpu",
                    "--detach-timeout", "2")  # fmt: skip
    try:
        wait_ready(server.addr, server.proc, 300)
        yield server
    finally:
        server.proc.stop(30)


@pytest.fixture(scope="session")
def relay(upstream: Server, redis_server: EmbeddedRedis,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:  # fmt: skip
    logs = tmp_path_factory.mktemp("relay-logs")
    server = _serve(logs, "relay", redis_server.url, "relay:", "--upstream", upstream.base)
    try:
        wait_ready(server.addr, server.proc, 60)
        yield server
    finally:
        server.proc.stop(30)


@pytest.fixture(scope="session")
def proxy(upstream: Server) -> Iterator[FaultProxy]:
    fp = FaultProxy(int(upstream.addr.rsplit(":", 1)[1]))
    try:
        yield fp
    finally:
        fp.close()


@pytest.fixture(scope="session")
def fault_relay(proxy: FaultProxy, redis_server: EmbeddedRedis,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:  # fmt: skip
    logs = tmp_path_factory.mktemp("fault-relay-logs")
    url, prefix, port = redis_server.url, "rfault:", free_port()
    worker = Proc(["worker", "--redis-url", url, "--redis-prefix", prefix, "--upstream",
                   proxy.url, "--upstream-timeout", str(CHUNK_TIMEOUT)],
                  logs / "worker.log")  # fmt: skip
    gateway = Proc(["gateway", "--redis-url", url, "--redis-prefix", prefix, "--port", str(port),
                    "--detach-timeout", str(DETACH_TIMEOUT)], logs / "gateway.log")  # fmt: skip
    server = Server(gateway, f"127.0.0.1:{port}", [worker])
    try:
        wait_ready(server.addr, gateway, 60)
        warm = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        resp = httpx.post(f"{server.base}/chat/completions", json=warm, timeout=60)
        assert resp.status_code == 200, resp.text  # the relay has learnt the model's name
        yield server
    finally:
        stop_all([gateway, worker], 30)


@pytest.fixture
def faults(proxy: FaultProxy, fault_relay: Server) -> Iterator[FaultProxy]:
    """The proxy in ``pass`` mode, and back in it after the test."""
    proxy.set_mode(PASS)
    try:
        yield proxy
    finally:
        proxy.set_mode(PASS)


async def run_ws(addr: str, prompt: str, rid: str, **params: Any) -> list[dict[str, Any]]:
    """The frames of one WebSocket generate, up to its ``done`` or ``error``."""
    c = await Client.open(addr)
    try:
        await c.send(generate_frame(prompt, rid, **params))
        return await c.recv_until(lambda f: f["type"] in ("done", "error"), 120)
    finally:
        with contextlib.suppress(Exception):
            await c.close()


def text_of(frames: list[dict[str, Any]]) -> str:
    return "".join(f["text"] for f in frames if f["type"] == "token")


async def wait_for(pred: Any, timeout: float = 20.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await asyncio.to_thread(pred):
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)
