"""What a relay passes on and brings back: logprobs, images, tool calls, refusals.

The upstream is a second ``tokenrelay serve`` with the default model, the relay
``tokenrelay serve --upstream`` (servers.py). Greedy decoding makes the upstream's answer
a fixed one, so what comes back through the relay must equal what the upstream gives
directly, and a resume must replay it.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import pytest

from tests.gateway.procs import Client
from tests.worker.upstream.servers import Server, run_ws
from tokenrelay.core.wire.content import TEXT_ONLY

pytestmark = pytest.mark.slow

PROMPT = "Name three colours of the rainbow."
PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 64).decode()


def logprobs_of(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every token's logprobs, in order, whatever events they came in."""
    return [e for f in frames if f["type"] == "token" for e in f.get("logprobs", [])]


def same_logprobs(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> bool:
    """The same tokens and bytes, the values within float noise (another batch on the
    upstream sums in another order), as many alternatives, most likely first."""
    assert [(e["token"], e["bytes"]) for e in got] == [(e["token"], e["bytes"]) for e in want]
    for g, w in zip(got, want, strict=True):
        assert g["logprob"] == pytest.approx(w["logprob"], abs=0.01)
        assert len(g["top_logprobs"]) == len(w["top_logprobs"])
        assert [t["logprob"] for t in g["top_logprobs"]] == pytest.approx(
            [t["logprob"] for t in w["top_logprobs"]], abs=0.01)  # fmt: skip
    return True


async def test_logprobs_come_back_through_the_relay_and_a_resume_replays_them(
    upstream: Server, relay: Server
) -> None:
    params = {"max_tokens": 12, "temperature": 0, "logprobs": 2}
    direct = await run_ws(upstream.addr, PROMPT, "lp-direct", **params)
    relayed = await run_ws(relay.addr, PROMPT, "lp-relayed", **params)
    assert relayed[-1]["type"] == "done", relayed[-1]
    got = logprobs_of(relayed)
    assert same_logprobs(got, logprobs_of(direct))
    assert len(got) == relayed[-1]["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 2 for e in got)
    started = relayed[0]
    c = await Client.open(relay.addr)
    await c.send({"type": "resume", "stream_id": started["stream_id"],
                  "resume_token": started["resume_token"], "after": 0})  # fmt: skip
    replay = await c.recv_until(lambda f: f["type"] in ("done", "error"))
    await c.close()
    assert [f for f in replay if f["type"] == "token"] == [
        f for f in relayed if f["type"] == "token"
    ]


def test_chat_logprobs_over_http_are_the_upstreams(upstream: Server, relay: Server) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
            "temperature": 0, "logprobs": True, "top_logprobs": 3}  # fmt: skip
    direct = httpx.post(f"{upstream.base}/chat/completions", json=body, timeout=60)
    relayed = httpx.post(f"{relay.base}/chat/completions", json=body, timeout=60)
    assert direct.status_code == relayed.status_code == 200, relayed.text
    want = direct.json()["choices"][0]["logprobs"]["content"]
    assert want and same_logprobs(relayed.json()["choices"][0]["logprobs"]["content"], want)
    plain = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
             "logprobs": 2}  # fmt: skip
    direct = httpx.post(f"{upstream.base}/completions", json=plain, timeout=60)
    relayed = httpx.post(f"{relay.base}/completions", json=plain, timeout=60)
    assert relayed.status_code == 200, relayed.text
    got, want = relayed.json()["choices"][0], direct.json()["choices"][0]
    assert got["text"] == want["text"] != ""
    got, want = got["logprobs"], want["logprobs"]
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=0.01)
    assert [sorted(t) for t in got["top_logprobs"]] == [sorted(t) for t in want["top_logprobs"]]


async def test_an_image_our_engine_refuses_comes_back_as_its_400_and_a_bad_request_frame(
    upstream: Server, relay: Server
) -> None:
    parts = [{"type": "text", "text": "What is in this picture?"},
             {"type": "image_url", "image_url": {"url": PNG}}]  # fmt: skip
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 8}
    for stream in (False, True):
        resp = httpx.post(f"{relay.base}/chat/completions", json={**body, "stream": stream},
                          timeout=60)  # fmt: skip
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "bad_request"
        assert TEXT_ONLY in error["message"] and "HTTP 400" in error["message"]
    c = await Client.open(relay.addr)
    await c.send({"type": "generate", "request_id": "img", "params": {"max_tokens": 8},
                  "messages": [{"role": "user", "content": parts}]})  # fmt: skip
    frames = await c.recv_until(lambda f: f["type"] in ("done", "error"))
    await c.close()
    assert frames[-1]["type"] == "error" and frames[-1]["code"] == "bad_request", frames
    assert TEXT_ONLY in frames[-1]["message"]
    direct = httpx.post(f"{upstream.base}/chat/completions", json=body, timeout=60)
    assert direct.status_code == 400 and TEXT_ONLY in direct.json()["error"]["message"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"]}}}  # fmt: skip
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = "What is the weather in Paris?"


def deltas_of(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for f in frames if f["type"] == "token" for d in f.get("tool_calls", [])]


async def test_tool_calls_stream_through_the_relay_as_deltas_and_resume(
    upstream: Server, relay: Server
) -> None:
    params = {"max_tokens": 48, "temperature": 0, "tools": [WEATHER], "tool_choice": NAMED}
    direct = await run_ws(upstream.addr, ASK, "tc-direct", **params)
    relayed = await run_ws(relay.addr, ASK, "tc-relayed", **params)
    done = relayed[-1]
    assert done["type"] == "done" and done["finish_reason"] == "tool_calls", done
    assert direct[-1]["finish_reason"] == "tool_calls", direct[-1]
    calls = [c["function"] for c in done["tool_calls"]]
    assert calls == [c["function"] for c in direct[-1]["tool_calls"]]
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {
        "city": "Paris"}  # fmt: skip
    deltas = deltas_of(relayed)  # the upstream's deltas, numbered and named ours
    assert deltas[0]["index"] == 0 and deltas[0]["id"] == done["tool_calls"][0]["id"]
    assert deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"]["arguments"] for d in deltas) == calls[0]["arguments"]
    started = relayed[0]
    c = await Client.open(relay.addr)
    await c.send({"type": "resume", "stream_id": started["stream_id"],
                  "resume_token": started["resume_token"], "after": 0})  # fmt: skip
    replay = await c.recv_until(lambda f: f["type"] in ("done", "error"))
    await c.close()
    assert replay[1:] == relayed[1:], replay  # ("resumed" in place of "started")


def test_tool_calls_over_http_are_the_upstreams(upstream: Server, relay: Server) -> None:
    body = {"messages": [{"role": "user", "content": ASK}], "max_tokens": 48,
            "temperature": 0, "tools": [WEATHER], "tool_choice": "required"}  # fmt: skip
    direct = httpx.post(f"{upstream.base}/chat/completions", json=body, timeout=60)
    relayed = httpx.post(f"{relay.base}/chat/completions", json=body, timeout=60)
    assert direct.status_code == relayed.status_code == 200, relayed.text
    want, got = direct.json()["choices"][0], relayed.json()["choices"][0]
    assert got["finish_reason"] == want["finish_reason"] == "tool_calls", got
    assert [c["function"] for c in got["message"]["tool_calls"]] == [
        c["function"] for c in want["message"]["tool_calls"]]  # fmt: skip
    pieces = []
    with httpx.stream("POST", f"{relay.base}/chat/completions", json={**body, "stream": True},
                      timeout=60) as resp:  # fmt: skip
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    pieces += choice["delta"].get("tool_calls") or []
    assert pieces and pieces[0]["function"]["name"] == "get_weather"
    joined = "".join(p["function"]["arguments"] for p in pieces)
    assert joined == got["message"]["tool_calls"][0]["function"]["arguments"]
