"""Resumable SSE end to end: cut and resume, cancel, detach, and both transports on one log."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx

from tests.gateway.http.conftest import ApiStack
from tests.gateway.http.helpers import LONG, Read, chat_body, read_sse, unique_seqs
from tests.gateway.procs import Client, generate_frame


def start(http: httpx.Client, addr: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    req = http.build_request("POST", f"http://{addr}/v1/chat/completions", json=body,
                             headers=headers)  # fmt: skip
    resp = http.send(req, stream=True)
    assert resp.status_code == 200, resp.read()
    return resp


@contextlib.contextmanager
def resume(
    http: httpx.Client, addr: str, sid: str, token: str, after: int | None, **params: str
) -> Iterator[httpx.Response]:
    headers = {"Last-Event-ID": str(after)} if after is not None else {}
    req = http.build_request(
        "GET",
        f"http://{addr}/v1/streams/{sid}/events",
        params={"resume_token": token, **params},
        headers=headers,
    )
    resp = http.send(req, stream=True)
    try:
        yield resp
    finally:
        resp.close()


def full_log(http: httpx.Client, addr: str, sid: str, token: str) -> Read:
    """The whole stream replayed from the log (after = -1: the role chunk too)."""
    with resume(http, addr, sid, token, None) as resp:
        assert resp.status_code == 200
        return read_sse(resp)


def test_cut_mid_answer_and_resume_with_last_event_id(
    api_stack: ApiStack, http: httpx.Client
) -> None:
    body = chat_body("Tell me a story about a fox.", max_tokens=40, temperature=0, ignore_eos=True,
                     stream=True, stream_options={"include_usage": True})  # fmt: skip
    resp = start(http, api_stack.a, body)
    headers = resp.headers
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache" and headers["x-accel-buffering"] == "no"
    sid, token = headers["x-stream-id"], headers["x-resume-token"]
    first = read_sse(resp, limit=6)
    resp.close()  # the client goes away mid-answer
    assert first.ids == list(range(6)) and not first.done
    with resume(http, api_stack.a, sid, token, first.last_id) as resp2:
        assert resp2.status_code == 200
        assert resp2.headers["x-stream-id"] == sid
        rest = read_sse(resp2)
    assert rest.done
    seqs = unique_seqs(first.ids + rest.ids)
    assert seqs == list(range(len(seqs)))  # no gap, no duplicate
    assert rest.ids[0] == first.last_id + 1
    assert rest.finish_reason == "length"
    usage = rest.chunks[-1]["usage"]
    assert rest.chunks[-1]["choices"] == [] and usage["completion_tokens"] == 40
    assert first.text + rest.text == full_log(http, api_stack.a, sid, token).text
    assert len(rest.chunks) + len(first.chunks) == 40 + 3  # role, 40 tokens, finish, usage
    # the same offset again: the same events again (resume is idempotent)
    with resume(http, api_stack.a, sid, token, first.last_id) as resp3:
        assert read_sse(resp3).chunks == rest.chunks
    # resuming at the very end: 204, so an EventSource stops reconnecting
    with resume(http, api_stack.a, sid, token, rest.last_id) as resp4:
        assert resp4.status_code == 204


def test_resume_on_another_gateway_with_query_only(api_stack: ApiStack, http: httpx.Client) -> None:
    """EventSource style: the token and the offset in the URL, no custom headers."""
    body = {"model": "default", "prompt": "The sea is", "max_tokens": 20, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    req = http.build_request("POST", f"http://{api_stack.a}/v1/completions", json=body)
    resp = http.send(req, stream=True)
    sid, token = resp.headers["x-stream-id"], resp.headers["x-resume-token"]
    first = read_sse(resp, limit=3)
    resp.close()
    url = f"http://{api_stack.b}/v1/streams/{sid}/events?resume_token={token}&after={first.last_id}"
    with http.stream("GET", url) as resp2:
        assert resp2.status_code == 200
        rest = read_sse(resp2)
    assert rest.done and rest.ids[0] == first.last_id + 1
    assert all(c["object"] == "text_completion" for c in rest.chunks)  # same format as started
    assert unique_seqs(first.ids + rest.ids) == list(range(1, 22))  # tokens 1..20, done 21
    # Last-Event-ID wins over ?after= (an EventSource reconnecting keeps its first URL)
    with http.stream("GET", url, headers={"Last-Event-ID": "15"}) as resp3:
        assert read_sse(resp3).ids[0] == 16


def test_cancel_over_http(api_stack: ApiStack, http: httpx.Client) -> None:
    resp = start(http, api_stack.a, chat_body("Write a long essay.", stream=True, **LONG))
    sid, token = resp.headers["x-stream-id"], resp.headers["x-resume-token"]
    first = read_sse(resp, limit=3)
    r = http.post(f"http://{api_stack.b}/v1/streams/{sid}/cancel", json={"resume_token": token})
    assert r.status_code == 200
    assert r.json() == {"stream_id": sid, "state": "cancelling", "finish_reason": None}
    rest = read_sse(resp)
    resp.close()
    assert rest.done and rest.finish_reason == "cancelled"
    assert unique_seqs(first.ids + rest.ids) == list(range(len(unique_seqs(first.ids + rest.ids))))
    again = http.post(f"http://{api_stack.a}/v1/streams/{sid}/cancel",
                      headers={"X-Resume-Token": token})  # fmt: skip
    assert again.json() == {"stream_id": sid, "state": "finished", "finish_reason": "cancelled"}
    q = http.post(f"http://{api_stack.a}/v1/streams/{sid}/cancel", params={"resume_token": token})
    assert q.status_code == 200


def wait_meta(stack: ApiStack, sid: str, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    meta = stack.stream_meta(sid)
    while time.monotonic() < deadline:
        meta = stack.stream_meta(sid)
        if meta.get("st") == "done":
            return meta
        time.sleep(0.2)
    raise AssertionError(f"stream not done: {meta}")


def test_disconnect_is_a_detach_not_a_cancel(api_stack: ApiStack, http: httpx.Client) -> None:
    """Gateway b: --detach-timeout 3. The stream outlives its client, then expires."""
    resp = start(http, api_stack.b, chat_body("Describe the ocean.", stream=True, **LONG))
    sid, token = resp.headers["x-stream-id"], resp.headers["x-resume-token"]
    first = read_sse(resp, limit=3)
    resp.close()
    cut_at = time.monotonic()
    meta = wait_meta(api_stack, sid, 60)
    assert meta["fr"] == "expired"
    assert time.monotonic() - cut_at >= 2.5
    with resume(http, api_stack.a, sid, token, first.last_id) as resp2:
        rest = read_sse(resp2)
    assert rest.done and rest.finish_reason == "expired"
    assert len(rest.chunks) > 3  # it kept generating while nobody was attached


def test_a_requests_detach_timeout_outlives_the_gateways(
    api_stack: ApiStack, http: httpx.Client
) -> None:
    """Gateway b: --detach-timeout 3. A request asking for 8 s (tokenrelay's extension
    field) keeps generating that long after its client went, then expires."""
    body = chat_body("Describe the ocean.", stream=True, detach_timeout=8, **LONG)
    resp = start(http, api_stack.b, body)
    sid, token = resp.headers["x-stream-id"], resp.headers["x-resume-token"]
    first = read_sse(resp, limit=3)
    resp.close()
    cut_at = time.monotonic()
    time.sleep(5.5)
    assert api_stack.stream_meta(sid).get("st") == "running"  # past the gateway's 3 s
    meta = wait_meta(api_stack, sid, 60)
    assert meta["fr"] == "expired" and time.monotonic() - cut_at >= 7.5
    with resume(http, api_stack.a, sid, token, first.last_id) as resp2:
        rest = read_sse(resp2)
    assert rest.done and rest.finish_reason == "expired"
    over = http.post(f"http://{api_stack.b}/v1/chat/completions",
                     json=chat_body("Hi", max_tokens=2, detach_timeout=601))  # fmt: skip
    assert over.status_code == 400 and over.json()["error"]["param"] == "detach_timeout"


def test_non_streaming_client_gone_is_a_detach(api_stack: ApiStack) -> None:
    rid = f"ns-gone-{time.monotonic_ns()}"
    body = chat_body("Write a long essay about rivers.", **LONG)
    with httpx.Client(timeout=httpx.Timeout(1.5, connect=10)) as short:
        try:
            short.post(f"http://{api_stack.b}/v1/chat/completions", json=body,
                       headers={"X-Request-Id": rid})  # fmt: skip
            raise AssertionError("a 4000-token answer cannot be that fast")
        except httpx.ReadTimeout:
            pass
    sid = api_stack.find_stream(rid)
    meta = wait_meta(api_stack, sid, 60)
    assert meta["fr"] == "expired"


async def test_sse_to_websocket(api_stack: ApiStack, http: httpx.Client) -> None:
    body = chat_body("List some fruits.", max_tokens=24, temperature=0, ignore_eos=True,
                     stream=True)  # fmt: skip
    resp = start(http, api_stack.a, body)
    sid, token = resp.headers["x-stream-id"], resp.headers["x-resume-token"]
    first = read_sse(resp, limit=5)
    resp.close()
    ws = await Client.open(api_stack.b)
    try:
        after = first.last_id
        await ws.send({"type": "resume", "stream_id": sid, "resume_token": token, "after": after})
        frames = await ws.recv_until(lambda f: f["type"] in ("done", "error"), 120)
    finally:
        await ws.close()
    assert frames[0] == {"type": "resumed", "stream_id": sid, "after": after}
    tokens, done = frames[1:-1], frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert [f["seq"] for f in tokens] == list(range(after + 1, done["seq"]))
    text = first.text + "".join(f["text"] for f in tokens)
    assert text == full_log(http, api_stack.a, sid, token).text
    assert done["usage"]["completion_tokens"] == 24


async def test_websocket_to_sse(api_stack: ApiStack, http: httpx.Client) -> None:
    ws = await Client.open(api_stack.a)
    try:
        await ws.send(generate_frame("Name some birds.", "ws1", max_tokens=24, temperature=0,
                                     ignore_eos=True))  # fmt: skip
        frames = await ws.recv_until(lambda f: f["type"] == "token" and f["seq"] >= 4, 120)
    finally:
        ws.cut()  # drop the socket abruptly
    started = next(f for f in frames if f["type"] == "started")
    sid, token = started["stream_id"], started["resume_token"]
    ws_tokens = [f for f in frames if f["type"] == "token"]
    await asyncio.sleep(0)
    with resume(http, api_stack.b, sid, token, ws_tokens[-1]["seq"], include_usage="true") as resp:
        assert resp.status_code == 200
        rest = read_sse(resp)
    assert rest.done and rest.finish_reason == "length"
    assert rest.ids[0] == ws_tokens[-1]["seq"] + 1
    assert all(c["object"] == "chat.completion.chunk" for c in rest.chunks)  # WS streams: chat
    assert rest.chunks[-1]["usage"]["completion_tokens"] == 24
    text = "".join(f["text"] for f in ws_tokens) + rest.text
    assert text == full_log(http, api_stack.a, sid, token).text
    assert json.dumps(rest.chunks)  # plain JSON all the way
