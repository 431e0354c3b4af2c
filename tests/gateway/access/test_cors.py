"""CORS preflights: which requested headers are allowed, and what a cache may keep.

Fast: the header parsing alone, then :class:`gateway.access.cors.CORSMiddleware` around a
tiny Starlette app (no gateway process). The real gateway is covered by
tests/gateway/access/test_security.py, and the official ``openai`` SDK from another
origin in Chromium by tests/web/test_openai_sdk_browser.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from tokenrelay.gateway.access.cors import (
    ALLOW_HEADERS,
    EXPOSE_HEADERS,
    MAX_HEADER_NAME,
    MAX_REQUEST_HEADERS,
    MAX_REQUEST_HEADERS_CHARS,
    CORSMiddleware,
    OriginPolicy,
    allow_headers,
)
from tokenrelay.gateway.errors import BadPreflight

# What openai 6.x sends from a browser (Chromium lists them lower-cased and sorted).
SDK_HEADERS = (
    "authorization,content-type,x-stainless-arch,x-stainless-lang,x-stainless-os,"
    "x-stainless-package-version,x-stainless-retry-count,x-stainless-runtime,"
    "x-stainless-runtime-version,x-stainless-timeout"
)
APP = "https://app.example.com"


def names(value: str) -> list[str]:
    return [n.strip() for n in value.split(",")]


# --- allow_headers: the parsing ----------------------------------------------------------


def test_no_request_headers_answers_the_fixed_list() -> None:
    assert allow_headers(None) == ALLOW_HEADERS
    assert allow_headers("") == ALLOW_HEADERS
    assert allow_headers(" , ,\t") == ALLOW_HEADERS  # empty items are skipped


def test_the_sdk_headers_are_echoed_after_the_fixed_list() -> None:
    got = names(allow_headers(SDK_HEADERS))
    assert got[: len(names(ALLOW_HEADERS))] == names(ALLOW_HEADERS)  # Authorization stays
    extra = got[len(names(ALLOW_HEADERS)) :]
    assert extra == [n for n in SDK_HEADERS.split(",") if n.startswith("x-stainless-")]


def test_names_are_lower_cased_and_listed_once() -> None:
    got = names(allow_headers("X-Custom , x-custom,AUTHORIZATION, Content-Type,\tx-Other"))
    assert got == [*names(ALLOW_HEADERS), "x-custom", "x-other"]


def test_bounds_are_inclusive() -> None:
    at_limit = ",".join(f"x-h{i:02d}" for i in range(MAX_REQUEST_HEADERS))
    assert len(names(allow_headers(at_limit))) == len(names(ALLOW_HEADERS)) + MAX_REQUEST_HEADERS
    long_name = "x-" + "a" * (MAX_HEADER_NAME - 2)
    assert names(allow_headers(long_name))[-1] == long_name


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (",".join(f"x-h{i}" for i in range(MAX_REQUEST_HEADERS + 1)), "over 64 headers"),
        ("x-" + "a" * (MAX_HEADER_NAME - 1), "over 64 characters"),
        ("x-a," + " " * MAX_REQUEST_HEADERS_CHARS, "over 4096 characters"),
        ("x-ok, bad name", "not a valid header name"),
        ("x-ok, x:colon", "not a valid header name"),
        ("x-ok, x\u00e9", "not a valid header name"),
        ('x-"quoted"', "not a valid header name"),
        ("x-a;b", "not a valid header name"),
        ("x-a\r\nx-b", "not a valid header name"),
    ],
)
def test_malformed_or_too_long_is_refused(value: str, reason: str) -> None:
    with pytest.raises(BadPreflight, match=reason):
        allow_headers(value)


# --- the middleware ------------------------------------------------------------------------


def echo(request: Request) -> Response:
    return JSONResponse({"ok": True}, headers={"X-Request-Id": "r1", "Vary": "Accept-Encoding"})


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = Starlette(routes=[Route("/v1/chat/completions", echo, methods=["POST"])])
    return TestClient(CORSMiddleware(app, OriginPolicy([APP])), base_url="http://gw.example:8000")


def preflight(client: TestClient, origin: str, request_headers: str | None) -> Any:
    """An OPTIONS preflight; the answer is the TestClient's (httpx-like) response."""
    headers = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    if request_headers is not None:
        headers["Access-Control-Request-Headers"] = request_headers
    return client.options("/v1/chat/completions", headers=headers)


@pytest.mark.parametrize("origin", [APP, "http://localhost:5173"])
def test_preflight_allows_what_the_sdk_asks_for(client: TestClient, origin: str) -> None:
    r = preflight(client, origin, SDK_HEADERS)
    assert r.status_code == 204 and r.content == b""
    assert r.headers["access-control-allow-origin"] == origin
    allowed = {n.lower() for n in names(r.headers["access-control-allow-headers"])}
    assert set(SDK_HEADERS.split(",")) <= allowed
    assert r.headers["access-control-allow-methods"] == "GET, POST, OPTIONS"
    assert r.headers["access-control-max-age"] == "600"
    assert "access-control-allow-credentials" not in r.headers  # bearer keys, no cookies
    vary = names(r.headers["vary"])
    assert vary == ["Origin", "Access-Control-Request-Method", "Access-Control-Request-Headers"]


def test_preflight_without_request_headers(client: TestClient) -> None:
    r = preflight(client, APP, None)
    assert r.status_code == 204
    assert r.headers["access-control-allow-headers"] == ALLOW_HEADERS


def test_bad_preflight_is_a_400_without_cors_headers(client: TestClient) -> None:
    r = preflight(client, APP, "x-ok, bad name")
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "bad_request"
    assert "not a valid header name" in r.json()["error"]["message"]
    assert not [h for h in r.headers if h.lower().startswith("access-control-")]
    assert "Access-Control-Request-Headers" in r.headers["vary"]
    r = preflight(client, APP, ",".join(f"x-h{i}" for i in range(200)))
    assert r.status_code == 400 and "over 64 headers" in r.json()["error"]["message"]


def test_refused_origin_gets_403_even_with_good_headers(client: TestClient) -> None:
    r = preflight(client, "https://evil.example", SDK_HEADERS)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert "access-control-allow-origin" not in r.headers


def test_actual_request_exposes_what_the_sdk_reads(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", headers={"Origin": APP})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == APP
    exposed = {n.lower() for n in names(r.headers["access-control-expose-headers"])}
    # the SDK reads x-request-id (request_id, errors) and retry-after (its retries);
    # the stream id and resume token are what a page needs to resume or cancel
    assert {"x-request-id", "retry-after", "x-stream-id", "x-resume-token"} <= exposed
    assert names(EXPOSE_HEADERS) == names(r.headers["access-control-expose-headers"])
    assert "Origin" in r.headers.get_list("vary")
    assert "Accept-Encoding" in r.headers.get_list("vary")  # the app's own Vary is kept
