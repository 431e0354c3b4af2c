"""``--max-log-bytes-per-key`` on a real gateway process: a key whose stream logs would pass
the limit gets ``overloaded`` at once, over the WebSocket and over HTTP, naming the limit,
and nothing of it is queued; another key is served.

No model: a WorkerStore heartbeat stands in for a live worker, and the streams stay
queued, each holding its reservation (gateway/streams/ledger.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.gateway.procs import Client, Proc, generate_frame, start_gateway, stop_all, wait_ready
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.keys import Keys
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.gateway.access.auth import key_id, key_id_secret
from tokenrelay.worker.store import WorkerStore

PREFIX = "logb:"
KEYS = {"a": "sk-log-bytes-a-0123456789", "b": "sk-log-bytes-b-0123456789"}
# one request of 8192 tokens reserves about 0.76 MiB: a second one passes 1 MiB
LONG = {"max_tokens": 8192}


@dataclass
class Gw:
    addr: str
    proc: Proc


@pytest.fixture(scope="module")
def gw(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gw]:
    logs = tmp_path_factory.mktemp("log-bytes")
    keys = Path(logs) / "keys.txt"
    keys.write_text("\n".join(KEYS.values()) + "\n")
    proc, addr = start_gateway(redis_server.url, PREFIX, logs, "--api-keys-file", str(keys),
                               "--max-log-bytes-per-key", "1mb")  # fmt: skip
    store = WorkerStore(redis_server.url, "logb-worker", prefix=PREFIX)
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            store.heartbeat(WorkerStats())
            stop.wait(0.5)

    beating = threading.Thread(target=beat, name="log-bytes-heartbeat", daemon=True)
    beating.start()
    try:
        wait_ready(addr, proc, 60, need_worker=False)
        yield Gw(addr, proc)
    finally:
        stop_all([proc])
        stop.set()
        beating.join(5)
        store.close()
        redis_server.client().delete(f"{PREFIX}requests")
    assert "Traceback" not in proc.log_text()


def ledger_of(redis: EmbeddedRedis, name: str) -> dict[str, int]:
    """Key ``name``'s ledger: stream id -> bytes, "" -> the total."""
    owner = "key:" + key_id(KEYS[name], key_id_secret(KEYS.values()))
    raw = redis.client().hgetall(Keys(PREFIX).ledger(owner)[1])
    return {k.decode(): int(v) for k, v in raw.items()}


async def test_a_key_past_its_log_bytes_is_refused_and_another_served(
    gw: Gw, redis_server: EmbeddedRedis
) -> None:
    a = await Client.open(gw.addr, additional_headers={"Authorization": f"Bearer {KEYS['a']}"})
    b = await Client.open(gw.addr, additional_headers={"Authorization": f"Bearer {KEYS['b']}"})
    try:
        await a.send(generate_frame("hi", "a1", **LONG))
        for _ in range(100):  # queued: its reservation is in the key's ledger
            if len(ledger_of(redis_server, "a")) == 2:
                break
            await asyncio.sleep(0.05)
        held = ledger_of(redis_server, "a")
        assert len(held) == 2 and held[""] > 1024**2 // 2
        await a.send(generate_frame("hi", "a2", **LONG))
        error = await a.recv(10)
        assert error["type"] == "error" and error["code"] == "overloaded", error
        assert error["request_id"] == "a2" and "--max-log-bytes-per-key" in error["message"]
        assert error["retry_after"] >= 1
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(
                f"http://{gw.addr}/v1/completions",
                json={"prompt": "hi", **LONG},
                headers={"Authorization": f"Bearer {KEYS['a']}"},
            )
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        assert r.json()["error"]["code"] == "overloaded"
        assert "--max-log-bytes-per-key" in r.json()["error"]["message"]
        assert ledger_of(redis_server, "a") == held  # the refused ones reserved nothing
        await b.send(generate_frame("hi", "b1", **LONG))  # another key: served
        for _ in range(100):
            if len(ledger_of(redis_server, "b")) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(ledger_of(redis_server, "b")) == 2
        with pytest.raises(TimeoutError):
            await b.recv(0.5)  # no error frame
    finally:
        await a.close()
        await b.close()
