"""The Python client's exceptions: one class per protocol error code, under one base.

An ``error`` frame (docs/protocol.md, "`error`") becomes the class of its code, carrying
the frame's ``message``, ``retry_after``, ``stream_id`` and ``request_id``; a code this
version does not know becomes :class:`InternalServerError` (``as_code`` of the protocol's
error table). :class:`ConnectionFailed` is the client's own: no socket could be opened or
kept after the retries. Catch :class:`TokenRelayError` for all of them.
"""

from __future__ import annotations

from tokenrelay.core.wire.errors import as_code
from tokenrelay.core.wire.vocabulary import ErrorCode

__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "ConnectionFailed",
    "InternalServerError",
    "NotFoundError",
    "OverloadedError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestTooLargeError",
    "TokenRelayError",
    "UnavailableError",
    "error_for",
]


class TokenRelayError(Exception):
    """An error the gateway answered (or the client's own, :class:`ConnectionFailed`).

    ``code`` is the protocol's error code; ``retry_after`` the server's hint in seconds
    (``rate_limited``, ``overloaded``), when it sent one.
    """

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        retry_after: float | None = None,
        stream_id: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.stream_id = stream_id
        self.request_id = request_id

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, code={str(self.code)!r})"


class BadRequestError(TokenRelayError):
    """``bad_request``: a field or value the gateway refuses (the message names it)."""

    code = ErrorCode.BAD_REQUEST


class AuthenticationError(TokenRelayError):
    """``unauthorized``: no valid API key (the gateway then closes the socket)."""

    code = ErrorCode.UNAUTHORIZED


class PermissionDeniedError(TokenRelayError):
    """``forbidden``: a wrong ``resume_token``, or an origin the gateway refuses."""

    code = ErrorCode.FORBIDDEN


class NotFoundError(TokenRelayError):
    """``not_found``: an unknown or expired stream, or a model no worker serves."""

    code = ErrorCode.NOT_FOUND


class RateLimitError(TokenRelayError):
    """``rate_limited``: over a per-key or per-socket limit, still so after the retries."""

    code = ErrorCode.RATE_LIMITED


class RequestTooLargeError(TokenRelayError):
    """``too_large``: the prompt, the messages or a frame over the gateway's limits."""

    code = ErrorCode.TOO_LARGE


class OverloadedError(TokenRelayError):
    """``overloaded``: too many requests queued, still so after the retries."""

    code = ErrorCode.OVERLOADED


class UnavailableError(TokenRelayError):
    """``unavailable``: no engine worker, Redis down, or a draining gateway, after the
    retries."""

    code = ErrorCode.UNAVAILABLE


class InternalServerError(TokenRelayError):
    """``internal`` (or a code this client does not know)."""

    code = ErrorCode.INTERNAL


class ConnectionFailed(UnavailableError):
    """No WebSocket to the gateway could be opened (or kept) within the retry limit."""


_CLASSES: dict[ErrorCode, type[TokenRelayError]] = {
    cls.code: cls
    for cls in (
        BadRequestError,
        AuthenticationError,
        PermissionDeniedError,
        NotFoundError,
        RateLimitError,
        RequestTooLargeError,
        OverloadedError,
        UnavailableError,
        InternalServerError,
    )
}
assert set(_CLASSES) == set(ErrorCode), "every protocol error code has its class"


def error_for(
    code: str | None,
    message: str,
    *,
    retry_after: float | None = None,
    stream_id: str | None = None,
    request_id: str | None = None,
) -> TokenRelayError:
    """The exception for protocol error ``code`` (unknown or missing: internal)."""
    cls = _CLASSES[as_code(code)]
    return cls(message, retry_after=retry_after, stream_id=stream_id, request_id=request_id)
