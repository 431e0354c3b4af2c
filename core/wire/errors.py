"""The protocol's error codes, in one table, sans I/O.

Every client-visible error carries one of :data:`ERROR_CODES` (docs/protocol.md,
"Errors"). A WebSocket ``error`` frame sends the code as is; the HTTP API
answers with the code's :attr:`ErrorCode.status` and OpenAI error
:attr:`ErrorCode.type` (docs/api.md, "Errors"). The messages every transport
shares for the same failure are defined here too.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ERRORS",
    "ERROR_CODES",
    "NO_SUCH_STREAM",
    "STORE_FULL",
    "STORE_UNREACHABLE",
    "STORE_UNREACHABLE_RESUME",
    "ErrorCode",
    "lookup",
]


@dataclass(frozen=True)
class ErrorCode:
    """One protocol error code and how each transport renders it."""

    code: str
    status: int  # the HTTP status
    type: str  # the OpenAI error ``type``
    retry_after: float | None = None  # the default HTTP ``Retry-After`` (seconds), if any
    retry_in_frame: bool = False  # a WebSocket ``error`` frame carries ``retry_after``


ERRORS: dict[str, ErrorCode] = {
    e.code: e
    for e in (
        ErrorCode("bad_request", 400, "invalid_request_error"),
        ErrorCode("unauthorized", 401, "authentication_error"),
        ErrorCode("forbidden", 403, "permission_error"),
        ErrorCode("not_found", 404, "invalid_request_error"),
        ErrorCode("rate_limited", 429, "rate_limit_error", 1.0, retry_in_frame=True),
        ErrorCode("too_large", 413, "invalid_request_error"),
        ErrorCode("overloaded", 503, "server_error", 1.0, retry_in_frame=True),
        ErrorCode("unavailable", 503, "server_error", 1.0),
        ErrorCode("internal", 500, "server_error"),
    )
}
ERROR_CODES = frozenset(ERRORS)

STORE_UNREACHABLE = "the stream store is unreachable"  # Redis is down: retry with backoff
STORE_UNREACHABLE_RESUME = f"{STORE_UNREACHABLE}; resume later"  # ... while streaming
NO_SUCH_STREAM = "no such stream (unknown or expired)"
STORE_FULL = "the stream store is full; retry later"  # Redis at maxmemory: no new streams


def lookup(code: str) -> ErrorCode:
    """The table entry for ``code``; an unknown code is ``internal``."""
    return ERRORS.get(code, ERRORS["internal"])
