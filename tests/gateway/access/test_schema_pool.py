"""Schema checks off the event loop (gateway/access/schema_pool.py), alone and in a gateway.

llguidance's verdict on a request's JSON schemas runs on the pool's threads and is awaited:
never on the loop, once per schema, within a bound (``overloaded`` beyond it). The last
test runs a real gateway (uvicorn, the session's Redis) whose schema check is held: its
``/healthz`` still answers, and the held request gets its answer once the check ends.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway.procs import Client, free_port, generate_frame
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire import schema_verdicts
from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.requests import Limits, RequestError, validate_params
from tokenrelay.gateway.access.schema_pool import BUSY, SchemaPool
from tokenrelay.gateway.server import build_server
from tokenrelay.gateway.state import Settings


class HeldChecks:
    """llguidance's verdict, recorded (schema text, thread) and held until ``gate`` opens."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.real = schema_verdicts.llguidance_verdict

    def __call__(self, text: str) -> str:
        self.calls.append((text, threading.current_thread().name))
        self.entered.set()
        assert self.gate.wait(20), "the held check was never let go"
        return self.real(text)


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> HeldChecks:
    held = HeldChecks()
    monkeypatch.setattr(schema_verdicts, "llguidance_verdict", held)
    return held


def fresh_format(schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``response_format`` no test has checked before (its verdict is not cached)."""
    body = schema or {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {**body, "title": uuid.uuid4().hex}
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": body}}


def parser(fmt: dict[str, Any]) -> Any:
    return lambda: validate_params({"response_format": fmt}, Limits())


def as_is(_: Any, exc: RequestError) -> Exception:
    return exc


async def test_the_check_runs_on_a_pool_thread_not_the_loop(checks: HeldChecks) -> None:
    pool = SchemaPool()
    try:
        params = await pool.parse(parser(fresh_format()), as_is)
        assert isinstance(params, SamplingParams) and params.guided is not None
        ((_, thread),) = checks.calls
        assert thread != threading.current_thread().name
        assert thread.startswith("schema-check")
    finally:
        pool.close()


async def test_concurrent_identical_schemas_share_one_check(checks: HeldChecks) -> None:
    pool = SchemaPool()
    fmt = fresh_format()
    checks.gate.clear()
    try:
        first = asyncio.create_task(pool.parse(parser(fmt), as_is))
        await asyncio.to_thread(checks.entered.wait, 10)
        second = asyncio.create_task(pool.parse(parser(fmt), as_is))
        await asyncio.sleep(0.05)
        assert not first.done() and not second.done()  # both wait for the one check
        checks.gate.set()
        a, b = await asyncio.gather(first, second)
        assert a.guided == b.guided and len(checks.calls) == 1
        await pool.parse(parser(fmt), as_is)  # later: from the cache, no job
        assert len(checks.calls) == 1 and pool.checked == 1
    finally:
        checks.gate.set()
        pool.close()


async def test_a_full_pool_answers_overloaded_at_once(checks: HeldChecks) -> None:
    pool = SchemaPool(threads=1, queue=0)
    checks.gate.clear()
    try:
        held = asyncio.create_task(pool.parse(parser(fresh_format()), as_is))
        await asyncio.to_thread(checks.entered.wait, 10)
        with pytest.raises(RequestError) as info:
            await pool.parse(parser(fresh_format()), as_is)  # refused, not queued
        assert info.value.code == "overloaded" and info.value.message == BUSY
        assert info.value.field == "response_format.json_schema.schema"
        assert len(checks.calls) == 1 and pool.refused == 1
        checks.gate.set()
        assert (await held).guided is not None
        assert (await pool.parse(parser(fresh_format()), as_is)).guided is not None  # room again
    finally:
        checks.gate.set()
        pool.close()


async def test_a_refused_schema_is_the_same_bad_request_as_inline(checks: HeldChecks) -> None:
    fmt = fresh_format({"oneOf": [{"type": "integer"}, {"type": "number"}]})
    pool = SchemaPool()
    try:
        with pytest.raises(RequestError) as pooled:
            await pool.parse(parser(fmt), as_is)
    finally:
        pool.close()
    with pytest.raises(RequestError) as inline:  # the cached verdict, checked in place
        parser(fmt)()
    assert pooled.value.code == inline.value.code == "bad_request"
    assert pooled.value.message == inline.value.message
    assert pooled.value.field == inline.value.field == "response_format.json_schema.schema"
    assert "oneOf constraints" in pooled.value.message and len(checks.calls) == 1


async def test_no_schema_no_job() -> None:
    pool = SchemaPool()
    assert (await pool.parse(lambda: 42, as_is)) == 42
    assert pool.checked == 0 and pool._executor is None


@pytest.mark.parametrize(("threads", "queue"), [(0, 1), (-1, 1), (1, -1), (True, 1), (1.5, 1)])
def test_bad_sizes_are_refused(threads: Any, queue: Any) -> None:
    with pytest.raises(ValueError, match="schema check"):
        SchemaPool(threads, queue)


# --- in a real gateway ---------------------------------------------------------------


@pytest.fixture
def gateway(redis_server: EmbeddedRedis, prefix: str) -> Iterator[str]:
    """A gateway (uvicorn, no worker) on its own thread and event loop; its address."""
    settings = Settings(redis_url=redis_server.url, redis_prefix=prefix, drain_timeout=0)
    port = free_port()
    server = build_server(settings, "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=server.run, name="gateway-loop", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the gateway did not start"
        time.sleep(0.02)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


async def test_healthz_answers_while_a_schema_check_is_held(
    gateway: str, checks: HeldChecks
) -> None:
    refused = fresh_format({"oneOf": [{"type": "integer"}, {"type": "number"}]})
    checks.gate.clear()
    client = await Client.open(gateway)
    try:
        await client.send(generate_frame("Hi", "held-ws", response_format=refused))
        assert await asyncio.to_thread(checks.entered.wait, 10)
        async with httpx.AsyncClient(base_url=f"http://{gateway}", timeout=5) as http:
            health = await http.get("/healthz")  # the held check is not on the loop
            assert health.status_code == 200
            assert not checks.gate.is_set() and len(checks.calls) == 1
            body = {"messages": [{"role": "user", "content": "Hi"}],
                    "response_format": fresh_format()}  # fmt: skip
            chat = asyncio.create_task(http.post("/v1/chat/completions", json=body))
            while len(checks.calls) < 2:  # the HTTP request's check waits for a thread too
                await asyncio.sleep(0.02)
            assert (await http.get("/healthz")).status_code == 200
            checks.gate.set()
            error = await client.recv(10)
            assert error["type"] == "error" and error["code"] == "bad_request"
            assert error["request_id"] == "held-ws" and "oneOf" in error["message"]
            answer = await chat  # checked and passed: then it finds no worker to serve it
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "unavailable"
        assert all(thread.startswith("schema-check") for _, thread in checks.calls)
    finally:
        checks.gate.set()
        await client.close()
