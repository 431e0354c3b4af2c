"""Fixtures for the HTTP API suite: a real engine worker and real gateways.

They reuse tests/gateway/procs.py (the same process helpers as the WebSocket
suite) with a key prefix of their own, ``api:``, on the session's
redis-server. Gateway ``a`` has the default settings, gateway ``b`` a
3-second detach timeout; :func:`extra_gateway` starts more with their own
flags and environment (API keys, per-client limits, no worker, no Redis).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.procs import Proc, free_port, start_worker, wait_ready
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.keys import Keys

PREFIX = "api:"
WORKER_ID = "api-worker"


def start_api_gateway(
    redis_url: str, prefix: str, log_dir: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[Proc, str]:
    """``tokenrelay gateway`` on a free port (like procs.start_gateway, plus env)."""
    port = free_port()
    args = ["gateway", "--redis-url", redis_url, "--redis-prefix", prefix, "--port", str(port)]
    proc = Proc([*args, *extra], log_dir / f"api-gateway-{port}.log", env=env)
    return proc, f"127.0.0.1:{port}"


@dataclass
class ApiStack:
    """An engine worker and two gateways (``b``: --detach-timeout 3) on prefix ``api:``."""

    redis: EmbeddedRedis
    prefix: str
    worker: Proc
    gw_a: Proc
    a: str
    gw_b: Proc
    b: str
    logs: Path
    extra: dict[str, tuple[Proc, str]] = field(default_factory=dict)

    def worker_stats(self) -> dict[str, Any]:
        raw = self.redis.client().hget(f"{self.prefix}w:{WORKER_ID}", "stats")
        return dict(json.loads(raw)) if raw else {}

    def stream_meta(self, stream_id: str) -> dict[str, str]:
        raw: dict[bytes, bytes] = self.redis.client().hgetall(Keys(self.prefix).meta(stream_id))  # type: ignore[assignment]
        return {k.decode(): v.decode() for k, v in raw.items()}

    def find_stream(self, request_id: str, timeout: float = 10.0) -> str:
        """The stream id of the request with this X-Request-Id."""
        client = self.redis.client()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for key in client.scan_iter(match=f"{self.prefix}m:*", count=1000):
                if client.hget(key, "rid") == request_id.encode():
                    return key.decode()[len(self.prefix) + 3 : -1]  # P m:{stream_id}
            time.sleep(0.1)
        raise AssertionError(f"no stream for request {request_id}")


@pytest.fixture(scope="session")
def api_stack(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ApiStack]:
    logs = tmp_path_factory.mktemp("api-logs")
    url = redis_server.url
    worker = start_worker(url, PREFIX, logs, "--worker-id", WORKER_ID, "--max-num-seqs", "64")
    gw_a, a = start_api_gateway(url, PREFIX, logs)
    gw_b, b = start_api_gateway(url, PREFIX, logs, "--detach-timeout", "3")
    stack = ApiStack(redis_server, PREFIX, worker, gw_a, a, gw_b, b, logs)
    try:
        wait_ready(a, gw_a, 300)
        wait_ready(b, gw_b, 60)
        yield stack
    finally:
        for proc, _ in stack.extra.values():
            proc.stop()
        for proc in (gw_a, gw_b, worker):
            proc.stop()


@pytest.fixture(scope="session")
def extra_gateway(api_stack: ApiStack) -> Callable[..., str]:
    """Start (once per name) another gateway; returns its address."""

    def start(
        name: str,
        *flags: str,
        env: dict[str, str] | None = None,
        redis_url: str | None = None,
        prefix: str = PREFIX,
        need_worker: bool = True,
    ) -> str:
        if name not in api_stack.extra:
            url = redis_url or api_stack.redis.url
            proc, addr = start_api_gateway(url, prefix, api_stack.logs, *flags, env=env)
            api_stack.extra[name] = (proc, addr)
            wait_ready(addr, proc, 60, need_worker=need_worker)
        return api_stack.extra[name][1]

    return start


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=httpx.Timeout(120, connect=10)) as client:
        yield client


os.environ.setdefault("OPENAI_API_KEY", "unused")  # the SDK insists on one
