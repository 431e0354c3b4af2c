"""Error statuses and OpenAI-style error bodies from real gateways (table-driven)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.gateway.http.conftest import ApiStack
from tests.gateway.http.helpers import LONG, chat_body, read_sse
from tests.gateway.procs import free_port

UNKNOWN_SID = "A" * 22


def assert_error(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if status in (429, 503):
        assert int(resp.headers["retry-after"]) >= 1
    return dict(err)


@pytest.fixture(scope="module")
def finished(api_stack: ApiStack) -> tuple[str, str]:
    """A finished stream: (stream_id, resume_token)."""
    r = httpx.post(f"http://{api_stack.a}/v1/chat/completions",
                   json=chat_body("Hi", max_tokens=3, temperature=0), timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.headers["x-stream-id"], r.headers["x-resume-token"]


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# (case, method, path, body (dict = JSON, bytes = raw), headers, status, code, param)
CASES: list[tuple[str, str, str, Any, dict[str, str], int, str | None, str | None]] = [
    ("invalid json", "POST", CHAT, b"{nope", {}, 400, "bad_request", None),
    ("json array", "POST", CHAT, b"[1]", {}, 400, "bad_request", None),
    ("empty body", "POST", CHAT, b"", {}, 400, "bad_request", None),
    ("missing messages", "POST", CHAT, {"model": "default"}, {}, 400, "bad_request", "messages"),
    ("n = 17", "POST", CHAT, chat_body("x", n=17), {}, 400, "bad_request", "n"),
    ("max_tokens str", "POST", CHAT, chat_body("x", max_tokens="9"), {}, 400, None, "max_tokens"),
    (
        "temperature bool",
        "POST",
        CHAT,
        chat_body("x", temperature=True),
        {},
        400,
        None,
        "temperature",
    ),
    ("stop dict", "POST", CHAT, chat_body("x", stop={"a": 1}), {}, 400, None, "stop"),
    ("stream str", "POST", CHAT, chat_body("x", stream="yes"), {}, 400, None, "stream"),
    (
        "unknown model",
        "POST",
        CHAT,
        chat_body("x", model="gpt-4o"),
        {},
        404,
        "model_not_found",
        "model",
    ),
    ("missing prompt", "POST", COMPLETIONS, {"model": "default"}, {}, 400, None, "prompt"),
    ("two prompts", "POST", COMPLETIONS, {"prompt": ["a", "b"]}, {}, 400, None, "prompt"),
    ("body over 1 MiB", "POST", CHAT, chat_body("x" * (1 << 20)), {}, 413, "too_large", None),
    ("input over the limit", "POST", CHAT, chat_body("x" * 200_001), {}, 413, "too_large", None),
    ("unknown model card", "GET", "/v1/models/nope", None, {}, 404, "model_not_found", "model"),
    (
        "events unknown stream",
        "GET",
        f"/v1/streams/{UNKNOWN_SID}/events?resume_token=t",
        None,
        {},
        404,
        "not_found",
        None,
    ),
    (
        "events malformed id",
        "GET",
        "/v1/streams/x!y/events?resume_token=t",
        None,
        {},
        404,
        "not_found",
        None,
    ),
    (
        "cancel unknown stream",
        "POST",
        f"/v1/streams/{UNKNOWN_SID}/cancel",
        {"resume_token": "t"},
        {},
        404,
        "not_found",
        None,
    ),
]


@pytest.mark.parametrize(
    ("case", "method", "path", "body", "headers", "status", "code", "param"),
    CASES,
    ids=[c[0] for c in CASES],
)
def test_bad_requests(
    api_stack: ApiStack,
    case: str,
    method: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    status: int,
    code: str | None,
    param: str | None,
) -> None:
    kw: dict[str, Any] = {"headers": headers}
    if isinstance(body, bytes):
        kw["content"] = body
    elif body is not None:
        kw["json"] = body
    resp = httpx.request(method, f"http://{api_stack.a}{path}", timeout=60, **kw)
    err = assert_error(resp, status, code)
    if param is not None:
        assert err["param"] == param
    if method == "POST" and path in (CHAT, COMPLETIONS):
        assert resp.headers["x-request-id"]


def test_stream_token_errors(api_stack: ApiStack, finished: tuple[str, str]) -> None:
    sid, token = finished
    base = f"http://{api_stack.a}/v1/streams/{sid}"
    assert_error(httpx.get(f"{base}/events"), 401, "unauthorized")
    assert_error(httpx.get(f"{base}/events", params={"resume_token": "wrong"}), 403, "forbidden")
    assert_error(httpx.post(f"{base}/cancel"), 401, "unauthorized")
    assert_error(httpx.post(f"{base}/cancel", json={"resume_token": "wrong"}), 403, "forbidden")
    assert_error(httpx.post(f"{base}/cancel", json={"resume_token": 5}), 400, "bad_request")
    assert_error(httpx.post(f"{base}/cancel", content=b"{x"), 400, "bad_request")
    ok = {"resume_token": token}
    bad_id = httpx.get(f"{base}/events", params=ok, headers={"Last-Event-ID": "abc"})
    assert_error(bad_id, 400, "bad_request")
    assert_error(httpx.get(f"{base}/events", params={**ok, "after": "999"}), 400, "bad_request")
    assert_error(httpx.get(f"{base}/events", params={**ok, "after": "-5"}), 400, "bad_request")
    # a finished stream replays in full from the start
    with httpx.stream("GET", f"{base}/events", params=ok, timeout=60) as resp:
        assert resp.status_code == 200
        read = read_sse(resp)
    assert read.done and read.ids[0] == 0 and read.finish_reason in ("stop", "length")


def test_worker_rejection_is_a_400(api_stack: ApiStack) -> None:
    """A prompt longer than the model's context: the worker refuses it; streaming or not."""
    long_prompt = "hello " * 9000
    for stream in (False, True):
        resp = httpx.post(f"http://{api_stack.a}{COMPLETIONS}",
                          json={"prompt": long_prompt, "max_tokens": 4, "stream": stream},
                          timeout=120)  # fmt: skip
        err = assert_error(resp, 400, "bad_request")
        assert "prompt" in err["message"]


def test_api_keys_and_per_client_limit(
    api_stack: ApiStack, extra_gateway: Callable[..., str]
) -> None:
    env = {"TOKENRELAY_API_KEYS": "sk-one,sk-two", "TOKENRELAY_HTTP_MAX_STREAMS_PER_CLIENT": "1"}
    addr = extra_gateway("limited", env=env)
    url = f"http://{addr}{CHAT}"
    assert_error(httpx.get(f"http://{addr}/v1/models"), 401, "unauthorized")
    bad = httpx.get(f"http://{addr}/v1/models", headers={"Authorization": "Bearer sk-nope"})
    assert_error(bad, 401, "unauthorized")
    one = {"Authorization": "Bearer sk-one"}
    two = {"Authorization": "Bearer sk-two"}
    assert httpx.get(f"http://{addr}/v1/models", headers=one).status_code == 200
    assert_error(httpx.post(url, json=chat_body("x")), 401, "unauthorized")
    with httpx.Client(timeout=120) as http:
        body = chat_body("Write a long essay.", stream=True, **LONG)
        with http.stream("POST", url, json=body, headers=one) as first:
            assert first.status_code == 200
            read_sse(first, limit=1)
            assert_error(http.post(url, json=chat_body("x"), headers=one), 429, "rate_limited")
            other = http.post(url, json=chat_body("x", max_tokens=2), headers=two)
            assert other.status_code == 200  # the limit is per API key
            sid, token = first.headers["x-stream-id"], first.headers["x-resume-token"]
        # the stream endpoints take the resume token, not an API key (EventSource sends none)
        cancel = http.post(f"http://{addr}/v1/streams/{sid}/cancel", json={"resume_token": token})
        assert cancel.status_code == 200
        again = http.post(url, json=chat_body("x", max_tokens=2), headers=one)
        assert again.status_code == 200  # the slot was released when the client left


def test_unavailable_statuses(api_stack: ApiStack, extra_gateway: Callable[..., str]) -> None:
    body = chat_body("x", max_tokens=2)
    no_worker = extra_gateway("no-worker", prefix="api-noworker:", need_worker=False)
    err = assert_error(httpx.post(f"http://{no_worker}{CHAT}", json=body), 503, "unavailable")
    assert "worker" in err["message"]
    full = extra_gateway("overloaded", "--max-pending", "0")
    assert_error(httpx.post(f"http://{full}{CHAT}", json=body), 503, "overloaded")
    dead = f"redis://127.0.0.1:{free_port()}/0"
    no_redis = extra_gateway("no-redis", redis_url=dead, need_worker=False)
    resp = httpx.post(f"http://{no_redis}{CHAT}", json=body, timeout=30)
    assert_error(resp, 503, "unavailable")
    stream = httpx.get(f"http://{no_redis}/v1/streams/{UNKNOWN_SID}/events?resume_token=t")
    assert_error(stream, 503, "unavailable")
