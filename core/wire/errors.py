"""The protocol's error codes, in one table, sans I/O.

Every client-visible error carries one of the :class:`ErrorCode` s (docs/protocol.md,
"`error`"). A WebSocket ``error`` frame sends the code as is; the HTTP API
answers with the code's :attr:`ErrorSpec.status` and OpenAI error
:attr:`ErrorSpec.type` (docs/api.md, "Errors"), and both take the retry hint of
:attr:`ErrorSpec.retry_after` unless a refusal knows better (a full Redis). The
messages every transport shares for the same failure, and the exceptions a refused
request raises (:class:`RequestError`, :class:`ResponseFormatError`, :class:`ToolError`),
are defined here too.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenrelay.core.wire.vocabulary import ErrorCode

__all__ = [
    "ERRORS",
    "ERROR_CODES",
    "NO_SUCH_STREAM",
    "STORE_FULL",
    "STORE_UNREACHABLE",
    "STORE_UNREACHABLE_RESUME",
    "ErrorCode",
    "ErrorSpec",
    "RequestError",
    "ResponseFormatError",
    "ToolError",
    "as_code",
    "lookup",
]


@dataclass(frozen=True)
class ErrorSpec:
    """One protocol error code and how each transport renders it."""

    code: ErrorCode
    status: int  # the HTTP status
    type: str  # the OpenAI error ``type``
    retry_after: float | None = None  # the default retry hint (seconds), if any
    retry_in_frame: bool = False  # a WebSocket ``error`` frame carries ``retry_after``


E = ErrorCode
ERRORS: dict[ErrorCode, ErrorSpec] = {
    e.code: e
    for e in (
        ErrorSpec(E.BAD_REQUEST, 400, "invalid_request_error"),
        ErrorSpec(E.UNAUTHORIZED, 401, "authentication_error"),
        ErrorSpec(E.FORBIDDEN, 403, "permission_error"),
        ErrorSpec(E.NOT_FOUND, 404, "invalid_request_error"),
        ErrorSpec(E.RATE_LIMITED, 429, "rate_limit_error", 1.0, retry_in_frame=True),
        ErrorSpec(E.TOO_LARGE, 413, "invalid_request_error"),
        ErrorSpec(E.OVERLOADED, 503, "server_error", 1.0, retry_in_frame=True),
        # no worker, Redis down, a draining gateway: what a store refusal has always said
        ErrorSpec(E.UNAVAILABLE, 503, "server_error", 2.0),
        ErrorSpec(E.INTERNAL, 500, "server_error"),
    )
}
ERROR_CODES = frozenset(ERRORS)
assert set(ErrorCode) == ERROR_CODES, "every code has its row"


class RequestError(ValueError):
    """A refused request: ``code`` (``bad_request`` or ``too_large``), message, field."""

    def __init__(self, code: ErrorCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field

    def __repr__(self) -> str:
        return f"RequestError({self.code!r}, {self.message!r}, {self.field!r})"


class ResponseFormatError(ValueError):
    """A refused ``response_format``: ``code`` (``bad_request`` or ``too_large``), ``field``."""

    def __init__(self, message: str, field: str, code: ErrorCode = ErrorCode.BAD_REQUEST) -> None:
        super().__init__(f"{field}: {message}")
        self.code = code
        self.field = field


class ToolError(ResponseFormatError):
    """A refused ``tools``/``tool_choice``/message field (``field`` names it)."""


STORE_UNREACHABLE = "the stream store is unreachable"  # Redis is down: retry with backoff
STORE_UNREACHABLE_RESUME = f"{STORE_UNREACHABLE}; resume later"  # ... while streaming
NO_SUCH_STREAM = "no such stream (unknown or expired)"
STORE_FULL = "the stream store is full; retry later"  # Redis at maxmemory: no new streams


def as_code(raw: str | None) -> ErrorCode:
    """A code as stored or received (a rejected event's ``c``): unknown or none is internal."""
    try:
        return ErrorCode(raw or ErrorCode.INTERNAL)
    except ValueError:
        return ErrorCode.INTERNAL


def lookup(code: str) -> ErrorSpec:
    """The table entry for ``code``; an unknown code is ``internal``."""
    try:
        return ERRORS[ErrorCode(code)]
    except ValueError:
        return ERRORS[ErrorCode.INTERNAL]
