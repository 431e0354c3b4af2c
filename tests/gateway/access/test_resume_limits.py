"""Resume floods (issue 37): a resume is admitted as a new stream is, and each stream takes
at most ``--max-resumes-per-stream`` readers on a gateway, over WebSocket, SSE and gRPC.

A real gateway process with keys, a rate limit, two readers per stream and gRPC on.
No model: a WorkerStore heartbeat stands in for a live worker and the test makes the
streams itself (they stay queued, so a reader reads until it is told to stop). Each
test draws on keys of its own: the rate limit and the slots count per key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tests.gateway.conftest import open_slog, open_wlog
from tests.gateway.grpc.client import GrpcClient, pb2
from tests.gateway.procs import Client, Proc, free_port, start_gateway, stop_all, wait_ready
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.core.wire.vocabulary import FinishReason
from tokenrelay.gateway.app import create_app
from tokenrelay.gateway.http.sse import SSEParser
from tokenrelay.gateway.state import Settings
from tokenrelay.gateway.streams.readers import REPLACE_AFTER
from tokenrelay.gateway.streams.store import NewStream
from tokenrelay.worker.store import WorkerStore

PREFIX = "resl:"
RATE = 10  # --rate-limit: requests (resumes) per minute per key
KEYS = {name: f"sk-resume-{name}-0123456789" for name in
        ("cap", "replace", "flood", "sse-flood", "slots")}  # fmt: skip
BODY = {"prompt": "hi", "params": {}}


@dataclass
class Gw:
    redis: EmbeddedRedis
    addr: str
    grpc: str
    proc: Proc


class Beat(threading.Thread):
    """A worker's heartbeat every 0.5 s: queued streams are not ended for want of one."""

    def __init__(self, url: str) -> None:
        super().__init__(name="resume-limits-heartbeat", daemon=True)
        self.store = WorkerStore(url, "resl-worker", prefix=PREFIX)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.store.heartbeat(WorkerStats())
            self.stop.wait(0.5)


@pytest.fixture(scope="module")
def gw(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gw]:
    logs = tmp_path_factory.mktemp("resume-limits")
    keys = logs / "keys.txt"
    keys.write_text("\n".join(KEYS.values()) + "\n")
    grpc_port = free_port()
    flags = ["--api-keys-file", str(keys), "--rate-limit", str(RATE),
             "--max-streams-per-key", "4", "--max-resumes-per-stream", "2",
             "--grpc-port", str(grpc_port), "--drain-timeout", "1"]  # fmt: skip
    proc, addr = start_gateway(redis_server.url, PREFIX, logs, *flags)
    beat = Beat(redis_server.url)
    beat.start()
    try:
        wait_ready(addr, proc, 60, need_worker=False)
        yield Gw(redis_server, addr, f"127.0.0.1:{grpc_port}", proc)
    finally:
        stop_all([proc])
        beat.stop.set()
        beat.join(5)
        beat.store.close()
        redis_server.client().delete(f"{PREFIX}requests")
    text = proc.log_text()
    assert "Traceback" not in text
    assert not any(key in text for key in KEYS.values()), "an API key was logged"


async def new_streams(
    redis: EmbeddedRedis, n: int, *, prefix: str = PREFIX, finished: bool = False
) -> list[NewStream]:
    """``n`` queued streams (a heartbeat says a worker runs; none takes them), or streams
    that ended already (``finished``: a resume replays them and ends)."""
    with open_wlog(redis.url, prefix):
        async with open_slog(redis.url, prefix) as store:
            out = [await store.create(BODY, f"r{i}", attach=False) for i in range(n)]
            if finished:
                for s in out:
                    assert await store.finish(s.stream_id, FinishReason.ERROR, "ended by a test")
            return out


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def resume(s: NewStream, after: int = 0) -> dict[str, Any]:
    return {"type": "resume", "stream_id": s.stream_id, "resume_token": s.resume_token,
            "after": after}  # fmt: skip


async def ws(gw: Gw, name: str) -> Client:
    return await Client.open(gw.addr, additional_headers=bearer(name))


def sse(
    http: httpx.AsyncClient, gw: Gw, s: NewStream, headers: dict[str, str]
) -> contextlib.AbstractAsyncContextManager[httpx.Response]:
    url = f"http://{gw.addr}/v1/streams/{s.stream_id}/events"
    return http.stream("GET", url, headers={"X-Resume-Token": s.resume_token, **headers})


async def sse_events(resp: httpx.Response, timeout: float = 10.0) -> list[str]:
    """The data of every event until the response ends."""
    parser, out = SSEParser(), []

    async def read() -> None:
        async for chunk in resp.aiter_bytes():
            out.extend(ev.data for ev in parser.feed(chunk))

    await asyncio.wait_for(read(), timeout)
    return out


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(30, connect=10)) as client:
        yield client


async def test_resumes_over_the_cap_get_overloaded_on_every_transport(
    gw: Gw, http: httpx.AsyncClient
) -> None:
    """Two readers of a stream here at most: a third, right after, is refused."""
    (s,) = await new_streams(gw.redis, 1)
    c1, c2, c3 = await ws(gw, "cap"), await ws(gw, "cap"), await ws(gw, "cap")
    g = await GrpcClient.open(gw.grpc, KEYS["cap"])
    try:
        for c in (c1, c2):
            await c.send(resume(s))
            assert (await c.recv(10))["type"] == "resumed"
        await c3.send(resume(s))
        err = await c3.recv(10)
        assert (err["type"], err["code"], err["stream_id"]) == ("error", "overloaded", s.stream_id)
        assert err["retry_after"] >= 1 and "at most 2" in err["message"]
        async with sse(http, gw, s, bearer("cap")) as resp:
            body = json.loads(await resp.aread())
            assert resp.status_code == 503 and body["error"]["code"] == "overloaded", body
            assert int(resp.headers["retry-after"]) >= 1
        await g.send(resume=pb2.Resume(stream_id=s.stream_id, resume_token=s.resume_token))
        err = await g.recv(10)
        assert (err["type"], err["code"], err["stream_id"]) == ("error", "overloaded", s.stream_id)
        await c1.close()  # a reader leaves: its seat is free at once
        await asyncio.sleep(0.3)
        await c3.send(resume(s))
        assert (await c3.recv(10))["type"] == "resumed"
    finally:
        for c in (c1, c2, c3):
            await c.close()
        await g.close()


async def test_a_resume_with_the_same_token_replaces_the_oldest_reader(
    gw: Gw, http: httpx.AsyncClient
) -> None:
    """The client whose old socket is half-open gets back in; the old reader is told why."""
    (s,) = await new_streams(gw.redis, 1)
    c1, c2 = await ws(gw, "replace"), await ws(gw, "replace")
    g = await GrpcClient.open(gw.grpc, KEYS["replace"])
    try:
        async with sse(http, gw, s, bearer("replace")) as old:  # the oldest reader
            assert old.status_code == 200
            await c1.send(resume(s))
            assert (await c1.recv(10))["type"] == "resumed"
            await asyncio.sleep(REPLACE_AFTER + 0.5)  # both have read a while
            await c2.send(resume(s))
            assert (await c2.recv(10))["type"] == "resumed"
            events = await sse_events(old)  # the replaced SSE reader ends, and says why
            assert events[-1] == "[DONE]", events
            error = json.loads(events[-2])["error"]
            assert error["code"] == "forbidden" and "newer resume" in error["message"], error
        await c1.send({"type": "ping"})
        assert (await c1.recv(10))["type"] == "pong"  # the others read on, undisturbed

        await asyncio.sleep(REPLACE_AFTER + 0.5)
        await g.send(resume=pb2.Resume(stream_id=s.stream_id, resume_token=s.resume_token))
        assert (await g.recv(10))["type"] == "resumed"
        err = await c1.recv(10)  # now c1 was the oldest
        assert (err["type"], err["code"], err["stream_id"]) == ("error", "forbidden", s.stream_id)
        assert "newer resume" in err["message"] and "retry_after" not in err
        await c2.send({"type": "ping"})
        assert (await c2.recv(10))["type"] == "pong"
    finally:
        for c in (c1, c2):
            await c.close()
        await g.close()


async def test_a_resume_flood_from_one_key_is_rate_limited(gw: Gw) -> None:
    """Each resume costs a request of --rate-limit (10 a minute), as a generate does."""
    (s,) = await new_streams(gw.redis, 1)
    c = await ws(gw, "flood")
    try:
        frames = []
        for _ in range(RATE + 3):  # the same stream again and again on one socket
            await c.send(resume(s))
            frames.append(await c.recv(10))
        kinds = [f.get("code", f["type"]) for f in frames]
        assert kinds[:RATE] == ["resumed"] * RATE and "rate_limited" in kinds[RATE:], kinds
        refused = next(f for f in frames if f.get("code") == "rate_limited")
        assert refused["stream_id"] == s.stream_id and refused["retry_after"] >= 1
    finally:
        await c.close()


async def test_sse_resumes_spend_rate_by_key_else_by_address(
    gw: Gw, http: httpx.AsyncClient
) -> None:
    (s,) = await new_streams(gw.redis, 1, finished=True)  # each resume replays it, then ends
    far = {"X-Forwarded-For": "203.0.113.50"}  # believed from 127.0.0.1: a client's address
    for caller in (bearer("sse-flood"), far):
        statuses = []
        for _ in range(RATE + 3):
            async with sse(http, gw, s, caller) as resp:
                body = await resp.aread()
                statuses.append(resp.status_code)
                if resp.status_code == 429:
                    assert json.loads(body)["error"]["code"] == "rate_limited", body
                    assert "requests per minute" in json.loads(body)["error"]["message"]
                    assert int(resp.headers["retry-after"]) >= 1
                else:
                    assert b"ended by a test" in body and body.endswith(b"data: [DONE]\n\n")
        assert statuses[:RATE] == [200] * RATE and 429 in statuses[RATE:], (caller, statuses)
    async with sse(http, gw, s, {"Authorization": "Bearer sk-wrong-key-0000"}) as resp:
        assert resp.status_code == 401  # a key that is sent must be right


async def test_sse_resumes_take_stream_slots(gw: Gw, http: httpx.AsyncClient) -> None:
    """--max-streams-per-key 4 counts SSE resumes too (each of its own stream here)."""
    streams = await new_streams(gw.redis, 5)
    async with contextlib.AsyncExitStack() as held:
        for s in streams[:4]:
            resp = await held.enter_async_context(sse(http, gw, s, bearer("slots")))
            assert resp.status_code == 200
        async with sse(http, gw, streams[4], bearer("slots")) as resp:
            body = json.loads(await resp.aread())
            assert resp.status_code == 429 and body["error"]["code"] == "rate_limited", body
            assert "per API key" in body["error"]["message"]
    await asyncio.sleep(0.3)  # the readers left: their slots are back
    async with sse(http, gw, streams[4], bearer("slots")) as resp:
        assert resp.status_code == 200


# --- the access log -------------------------------------------------------------------


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def test_the_access_log_never_shows_a_resume_token(
    redis_server: EmbeddedRedis, prefix: str
) -> None:
    """uvicorn with its access log on (the gateway's app as any deployment may run it):
    the line of a resume with ``?resume_token=`` (in any spelling the gateway accepts)
    names the path, not the token."""
    access = logging.getLogger("uvicorn.access")
    lines = Lines()
    access.addHandler(lines)
    kept = {name: logging.getLogger(name).level for name in ("uvicorn.error", "uvicorn.access")}
    propagate = access.propagate
    port = free_port()
    app = create_app(Settings(redis_url=redis_server.url, redis_prefix=prefix))
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                            access_log=True, log_level="info", lifespan="on")  # fmt: skip
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not serving.done(), "the server did not start"
            await asyncio.sleep(0.05)
        (s,) = await new_streams(redis_server, 1, prefix=prefix)
        base = f"http://127.0.0.1:{port}/v1/streams/{s.stream_id}/events"
        secrets = {"Q-SECRET-plain": "resume_token", "Q-SECRET-encoded": "resume%5Ftoken",
                   "Q-SECRET-hex": "%72esume_token"}  # fmt: skip
        async with httpx.AsyncClient(timeout=10) as http:
            for secret, name in secrets.items():
                r = await http.get(f"{base}?after=0&{name}={secret}")
                assert r.status_code == 403  # the gateway read it as the token (a wrong one)
        await asyncio.sleep(0.2)
        mine = [line for line in lines.lines if s.stream_id in line]
        assert len(mine) == 3, lines.lines
        for line in mine:
            assert "SECRET" not in line and "=[redacted]" in line and "after=0" in line, line
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 30)
        access.removeHandler(lines)
        access.propagate = propagate
        for name, level in kept.items():
            logging.getLogger(name).setLevel(level)


def test_nginx_logs_paths_without_query_strings() -> None:
    """docker/nginx.conf: the access log's format has no query string in it."""
    from tests.root import ROOT

    conf = (Path(ROOT) / "docker" / "nginx.conf").read_text()
    formats = conf.split("log_format tokenrelay", 1)[1].split(";", 1)[0]
    assert "$uri" in formats
    for leaky in ("$request ", '$request"', "$request_uri", "$args", "$query_string", "$arg_"):
        assert leaky not in formats, leaky
    assert "access_log /var/log/nginx/access.log tokenrelay;" in conf
