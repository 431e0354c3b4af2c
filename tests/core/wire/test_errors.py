"""core/wire/errors.py: one table of error codes, used by the WebSocket and HTTP alike."""

from __future__ import annotations

import pytest

from tokenrelay.core.wire.errors import (
    ERROR_CODES,
    ERRORS,
    NO_SUCH_STREAM,
    STORE_UNREACHABLE,
    STORE_UNREACHABLE_RESUME,
    lookup,
)
from tokenrelay.gateway.errors import (
    STORE_ERRORS,
    BadOffset,
    EventsTrimmed,
    NoWorker,
    Overloaded,
    RedisUnavailable,
    ShuttingDown,
    StreamForbidden,
    StreamNotFound,
    refusal,
)
from tokenrelay.gateway.http.common import store_error
from tokenrelay.gateway.http.openai_request import error_for_code
from tokenrelay.gateway.session import protocol as p

DOCUMENTED = {  # docs/protocol.md "`error`" and docs/api.md "Errors"
    "bad_request": (400, "invalid_request_error"),
    "unauthorized": (401, "authentication_error"),
    "forbidden": (403, "permission_error"),
    "not_found": (404, "invalid_request_error"),
    "rate_limited": (429, "rate_limit_error"),
    "too_large": (413, "invalid_request_error"),
    "overloaded": (503, "server_error"),
    "unavailable": (503, "server_error"),
    "internal": (500, "server_error"),
}


def test_every_code_has_a_status_and_type() -> None:
    assert ERROR_CODES == set(DOCUMENTED) == set(ERRORS)
    for code, (status, kind) in DOCUMENTED.items():
        entry = lookup(code)
        assert (entry.code, entry.status, entry.type) == (code, status, kind)
        assert (entry.retry_after is not None) == (status in (429, 503)), code
    assert lookup("teapot") is ERRORS["internal"]


def test_both_transports_take_the_code_from_the_table() -> None:
    assert p.ERROR_CODES is ERROR_CODES
    for code, entry in ERRORS.items():
        api = error_for_code(code, "m")
        assert (api.status, api.type, api.code) == (entry.status, entry.type, code)
        assert ("Retry-After" in api.headers()) == (entry.retry_after is not None)
        frame = p.ProtocolError(code, "m", retry_after=3).frame()
        assert frame["code"] == code
        assert ("retry_after" in frame) == entry.retry_in_frame
    assert {c for c, e in ERRORS.items() if e.retry_in_frame} == {"rate_limited", "overloaded"}


CASES: list[tuple[Exception, str, str, float | None]] = [
    (NoWorker("no engine worker"), "unavailable", "no engine worker", 2),
    (ShuttingDown("draining"), "unavailable", "draining", 2),
    (Overloaded("queue full"), "overloaded", "queue full", 1),
    (StreamNotFound("gone"), "not_found", "gone", None),
    (StreamNotFound(), "not_found", NO_SUCH_STREAM, None),
    (EventsTrimmed("trimmed"), "not_found", "trimmed", None),
    (StreamForbidden("wrong token"), "forbidden", "wrong token", None),
    (BadOffset("after 9 > 3"), "bad_request", "after 9 > 3", None),
    (RedisUnavailable("redis is unreachable"), "unavailable", STORE_UNREACHABLE, 2),
]


@pytest.mark.parametrize(("exc", "code", "message", "retry"), CASES, ids=[c[1] for c in CASES])
def test_store_exceptions_map_once(
    exc: Exception, code: str, message: str, retry: float | None
) -> None:
    assert isinstance(exc, STORE_ERRORS)
    r = refusal(exc)
    assert (r.code, r.message, r.retry_after) == (code, message, retry)
    api = store_error(exc)
    assert (api.code, api.message, api.status) == (code, message, lookup(code).status)
    assert api.param == ("after" if isinstance(exc, BadOffset) else None)


def test_an_outage_while_streaming_says_resume_later() -> None:
    assert STORE_UNREACHABLE_RESUME == "the stream store is unreachable; resume later"
    assert refusal(RedisUnavailable(), streaming=True).message == STORE_UNREACHABLE_RESUME
    assert store_error(RedisUnavailable(), streaming=True).message == STORE_UNREACHABLE_RESUME
    assert refusal(StreamNotFound("gone"), streaming=True).message == "gone"


def test_exposed_headers_defined_once() -> None:
    from tokenrelay.gateway.access import cors
    from tokenrelay.gateway.http import common

    assert "Retry-After" in cors.EXPOSE_HEADERS
    assert not hasattr(common, "EXPOSED")
