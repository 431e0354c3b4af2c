"""The client's retry policy and error classes, sans I/O."""

from __future__ import annotations

import pytest

from tokenrelay.client import (
    AuthenticationError,
    ConnectionFailed,
    InternalServerError,
    OverloadedError,
    RetryPolicy,
    TokenRelayError,
    UnavailableError,
)
from tokenrelay.client.errors import error_for
from tokenrelay.client.retry import RETRYABLE_CODES
from tokenrelay.core.wire.vocabulary import ErrorCode


def test_backoff_doubles_up_to_its_maximum_with_jitter() -> None:
    top = RetryPolicy(random=lambda: 0.0)  # no jitter drawn: the full delay
    assert [top.backoff(a) for a in range(7)] == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
    low = RetryPolicy(random=lambda: 1.0)  # all the jitter: half of it
    assert low.backoff(0) == 0.125 and low.backoff(20) == 5.0


def test_retry_delay_honours_retry_after_and_the_limit() -> None:
    p = RetryPolicy(limit=2, random=lambda: 0.0)
    assert p.retry_delay(1, ErrorCode.OVERLOADED, 3.0) == 3.25  # the server's hint + backoff
    assert p.retry_delay(2, ErrorCode.RATE_LIMITED, None) == 1.5  # the code's default hint
    assert p.retry_delay(1, ErrorCode.UNAVAILABLE, None) == 2.25
    assert p.retry_delay(3, ErrorCode.OVERLOADED, 1.0) is None  # over the limit
    assert p.retry_delay(1, ErrorCode.OVERLOADED, 60.0) is None  # longer than max_delay
    assert p.retry_delay(1, ErrorCode.BAD_REQUEST, None) is None  # not retryable
    assert {"unavailable", "overloaded", "rate_limited"} == RETRYABLE_CODES


@pytest.mark.parametrize("code", list(ErrorCode))
def test_each_code_has_its_exception(code: ErrorCode) -> None:
    exc = error_for(code, "m", retry_after=1.0, stream_id="S", request_id="r")
    assert isinstance(exc, TokenRelayError) and exc.code == code
    assert (exc.message, exc.retry_after, exc.stream_id, exc.request_id) == ("m", 1.0, "S", "r")
    assert str(exc) == f"{code}: m"


def test_unknown_codes_and_the_clients_own_errors() -> None:
    assert type(error_for("gremlins", "m")) is InternalServerError
    assert type(error_for(None, "m")) is InternalServerError
    assert type(error_for("overloaded", "m")) is OverloadedError
    assert type(error_for("unauthorized", "m")) is AuthenticationError
    failed = ConnectionFailed("no socket")
    assert isinstance(failed, UnavailableError) and failed.code == ErrorCode.UNAVAILABLE
