"""A mixed fleet behind one gateway: each request reaches a worker of the model it names.

One ``tokenrelay gateway`` and two relay workers in front of the session's upstream
(a ``tokenrelay serve`` of the default model): ``alpha-w`` serves it under the name
``alpha`` (``--model-name``), ``beta-w`` under the upstream's own name ``default`` (its
``/v1/models`` list). Which worker ran a stream is in the stream's metadata (``w``).
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.gateway.procs import Client, Proc, free_port, generate_frame, stop_all, wait_ready
from tests.worker.upstream.servers import Server, text_of, wait_for
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.keys import Keys

pytestmark = pytest.mark.slow

PREFIX = "fleet:"
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}


@dataclass
class Fleet:
    gateway: Server
    redis: EmbeddedRedis
    logs: Path

    def relay(self, upstream: Server, worker_id: str, *extra: str) -> Proc:
        args = ["worker", "--redis-url", self.redis.url, "--redis-prefix", PREFIX,
                "--worker-id", worker_id, "--upstream", upstream.base, *extra]  # fmt: skip
        return Proc(args, self.logs / f"{worker_id}.log")

    def models(self) -> list[str]:
        resp = httpx.get(f"{self.gateway.base}/models", timeout=10)
        assert resp.status_code == 200, resp.text
        return [m["id"] for m in resp.json()["data"]]

    def worker_of(self, stream_id: str) -> str:
        raw = self.redis.client().hget(Keys(PREFIX).meta(stream_id), "w")
        return raw.decode() if isinstance(raw, bytes) else str(raw)


@pytest.fixture(scope="module")
def fleet(
    upstream: Server, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("fleet-logs")
    port = free_port()
    gateway = Proc(["gateway", "--redis-url", redis_server.url, "--redis-prefix", PREFIX,
                    "--port", str(port)], logs / "gateway.log")  # fmt: skip
    out = Fleet(Server(gateway, f"127.0.0.1:{port}"), redis_server, logs)
    workers = [out.relay(upstream, "alpha-w", "--model-name", "alpha"),
               out.relay(upstream, "beta-w")]  # fmt: skip
    out.gateway.extra = workers
    try:
        wait_ready(out.gateway.addr, gateway, 60)
        asyncio.run(wait_for(lambda: set(out.models()) == {"alpha", "default"}, 30, "both"))
        yield out
    finally:
        stop_all([gateway, *workers], 30)


def post(fleet: Fleet, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{fleet.gateway.base}/{path}", json=body, timeout=60)


def test_the_models_of_every_live_worker_are_listed(fleet: Fleet) -> None:
    assert fleet.models() == ["alpha", "default"]  # workers in id order
    card = httpx.get(f"{fleet.gateway.base}/models/alpha", timeout=10)
    assert card.status_code == 200 and card.json()["id"] == "alpha"
    missing = httpx.get(f"{fleet.gateway.base}/models/nope", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_each_request_reaches_a_worker_of_its_model(fleet: Fleet) -> None:
    answers = {}
    for model, worker in (("alpha", "alpha-w"), ("default", "beta-w"), (None, "beta-w")):
        body = dict(CHAT, model=model) if model else CHAT
        resp = post(fleet, "chat/completions", body)
        assert resp.status_code == 200, resp.text
        assert fleet.worker_of(resp.headers["x-stream-id"]) == worker, model
        assert resp.json()["model"] == (model or "default")
        answers[model] = resp.json()["choices"][0]["message"]["content"]
    assert answers["alpha"] == answers["default"] != ""  # the same upstream model, greedy
    completion = post(fleet, "completions", {"model": "alpha", "prompt": "Hi", "max_tokens": 2})
    assert completion.status_code == 200, completion.text
    assert fleet.worker_of(completion.headers["x-stream-id"]) == "alpha-w"


def test_an_unknown_model_is_a_404_at_once_on_both_apis(fleet: Fleet) -> None:
    for path, body in (
        ("chat/completions", dict(CHAT, model="gpt-4")),
        ("completions", {"model": "gpt-4", "prompt": "Hi"}),
    ):
        resp = post(fleet, path, body)
        assert resp.status_code == 404, resp.text
        error = resp.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "`alpha`" in error["message"]  # it says what is served
    assert not fleet.redis.client().keys(f"{PREFIX}requests:gpt-4")  # nothing was queued


async def test_a_websocket_generate_names_its_model(fleet: Fleet) -> None:
    c = await Client.open(fleet.gateway.addr)
    try:
        await c.send({**generate_frame("Say hi.", "ws-a", max_tokens=4, temperature=0),
                      "model": "alpha"})  # fmt: skip
        frames = await c.recv_until(lambda f: f["type"] in ("done", "error"))
        assert frames[0]["type"] == "started", frames[0]
        assert fleet.worker_of(frames[0]["stream_id"]) == "alpha-w"
        assert frames[-1]["type"] == "done" and text_of(frames)
        await c.send({**generate_frame("Hi", "ws-x"), "model": "gpt-4"})
        error = await c.recv()
        assert (error["type"], error["code"], error["request_id"]) == ("error", "not_found", "ws-x")
        await c.send({**generate_frame("Hi", "ws-bad"), "model": 7})
        assert (await c.recv())["code"] == "bad_request"
    finally:
        await c.close()


async def test_relay_metrics_and_summaries_carry_the_backend_and_upstream_ttft(
    fleet: Fleet,
) -> None:
    assert post(fleet, "chat/completions", dict(CHAT, model="alpha")).status_code == 200
    hist = "tokenrelay_upstream_time_to_first_token_seconds_count"
    await wait_for(lambda: fleet.gateway.metric(hist, backend="upstream") >= 1, 10, "histogram")
    assert fleet.gateway.metric("tokenrelay_worker_info", worker_id="alpha-w",
                                backend="upstream") == 1  # fmt: skip
    assert fleet.gateway.metric("tokenrelay_worker_models", worker_id="beta-w",
                                model="default") == 1  # fmt: skip
    summaries = [json.loads(line) for line in (fleet.logs / "alpha-w.log").read_text().splitlines()
                 if '"stream summary"' in line]  # fmt: skip
    assert summaries, "no summary line"
    last = summaries[-1]
    assert last["backend"] == "upstream" and last["upstream_ttft_s"] > 0


async def test_a_dead_workers_model_leaves_the_list_and_is_then_unknown(
    fleet: Fleet, upstream: Server
) -> None:
    gamma = fleet.relay(upstream, "gamma-w", "--model-name", "gamma")
    try:
        await wait_for(lambda: "gamma" in fleet.models(), 30, "gamma listed")
        resp = post(fleet, "chat/completions", dict(CHAT, model="gamma"))
        assert resp.status_code == 200 and fleet.worker_of(resp.headers["x-stream-id"]) == "gamma-w"
        gamma.signal(signal.SIGKILL)  # no goodbye: its heartbeat expires
        await wait_for(lambda: "gamma" not in fleet.models(), 15, "gamma gone")
        gone = post(fleet, "chat/completions", dict(CHAT, model="gamma"))
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert fleet.models() == ["alpha", "default"]
    finally:
        gamma.stop(10)
