"""The gateway's exceptions, and what each of the stream store's tells the client.

The access layer's (:class:`AuthError`, :class:`RateLimited`, :class:`TooManyStreams`,
:class:`BadPreflight`), gRPC's :class:`GrpcUnavailable`, the per-stream reader cap's
(:class:`TooManyReaders`, :class:`ReaderReplaced`), and the stream store's below.
The two that render themselves stay with their format: ``ProtocolError`` (a WebSocket
``error`` frame, gateway/session/protocol.py) and ``ApiError`` (an OpenAI error body,
gateway/http/openai_request.py).

The gateway's parts that reach Redis (gateway/streams/: the store, its tailer and
subscriptions, model routing) raise these; :func:`refusal` maps each to a protocol error
code and message, which the WebSocket (gateway/ws/connection.py) makes an ``error``
frame of and the HTTP API (gateway/http/common.py) an OpenAI-style error body. The retry
hint is the code's own (core/wire/errors.py) but for a full Redis, which frees memory
only as finished streams expire.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenrelay.core.wire.errors import (
    NO_SUCH_STREAM,
    STORE_FULL,
    STORE_UNREACHABLE,
    STORE_UNREACHABLE_RESUME,
    lookup,
)
from tokenrelay.core.wire.vocabulary import ErrorCode

__all__ = [
    "STORE_ERRORS",
    "AuthError",
    "BadOffset",
    "BadPreflight",
    "EventsTrimmed",
    "GrpcUnavailable",
    "LogBytesFull",
    "NoWorker",
    "Overloaded",
    "RateLimited",
    "ReaderReplaced",
    "RedisFull",
    "RedisUnavailable",
    "Refusal",
    "ShuttingDown",
    "StreamForbidden",
    "StreamNotFound",
    "TooManyReaders",
    "TooManyStreams",
    "UnknownModel",
    "refusal",
]


class StreamNotFound(Exception):
    """The stream does not exist (never did, or expired)."""


class RedisUnavailable(Exception):
    """Redis cannot be reached right now."""


class RedisFull(RedisUnavailable):
    """Redis is at its ``maxmemory`` (or nearly, for a new stream): it takes no writes now.

    Reads still work. Whoever waits out an outage waits this out too; a new
    stream is refused with ``overloaded`` (gateway/errors.py).
    """


class StreamForbidden(Exception):
    """The resume token does not match the stream."""


class EventsTrimmed(StreamNotFound):
    """The events right after the requested offset are no longer kept."""


class BadOffset(ValueError):
    """``after`` lies beyond the last event of the stream."""


class Overloaded(Exception):
    """Too many requests are waiting for an engine worker (``retry_after``: seconds, when
    the refusal knows better than the code's own hint)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class LogBytesFull(Overloaded):
    """The caller's stream logs in Redis would pass ``--max-log-bytes-per-key`` with this
    stream's (core/wire/log_ledger.py): ``overloaded``, until some of them expire."""


class TooManyReaders(Overloaded):
    """A resume of a stream whose ``--max-resumes-per-stream`` readers here are all too
    young to give way (gateway/streams/readers.py): ``overloaded``."""


class ReaderReplaced(Exception):
    """A newer resume of the stream took this reader's seat: it stops reading. ``forbidden``
    (not retried: the newer resume is the stream's reader now)."""


class NoWorker(Exception):
    """No engine worker is alive."""


class ShuttingDown(NoWorker):
    """This gateway is draining: it takes no new requests."""


class UnknownModel(LookupError):
    """No live worker serves the requested model."""


class AuthError(Exception):
    """No valid credentials: the client gets ``unauthorized`` (401 / close 1008)."""


class RateLimited(Exception):
    """Over the per-key request rate: ``rate_limited`` (429) with ``Retry-After``."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TooManyStreams(Exception):
    """The key already has ``--max-streams-per-key`` streams open here."""


class BadPreflight(ValueError):
    """A preflight's ``Access-Control-Request-Headers`` is malformed or too long."""


class GrpcUnavailable(RuntimeError):
    """gRPC cannot be served by this installation (a package or the built code is missing)."""


STORE_ERRORS = (
    NoWorker,
    Overloaded,  # TooManyReaders too
    UnknownModel,
    StreamNotFound,
    StreamForbidden,
    BadOffset,
    RedisUnavailable,
)
FULL_RETRY_AFTER = 5.0  # seconds: a full Redis frees memory as finished streams expire


@dataclass(frozen=True)
class Refusal:
    """A client-visible error: protocol ``code``, ``message``, retry hint, offending field."""

    code: ErrorCode
    message: str
    retry_after: float | None = None  # seconds
    param: str | None = None

    @classmethod
    def of(cls, code: ErrorCode, message: str, param: str | None = None) -> Refusal:
        """A refusal with its code's own retry hint (the error table's)."""
        return cls(code, message, lookup(code).retry_after, param)


def refusal(exc: BaseException, *, streaming: bool = False) -> Refusal:
    """The :class:`Refusal` for a stream-store exception (anything else: Redis is down).

    ``streaming``: the stream was already being delivered, so an outage tells the
    client to resume later.
    """
    E = ErrorCode
    if isinstance(exc, NoWorker):  # ShuttingDown too
        return Refusal.of(E.UNAVAILABLE, str(exc))
    if isinstance(exc, Overloaded):  # TooManyReaders too
        if exc.retry_after is not None:
            return Refusal(E.OVERLOADED, str(exc), retry_after=exc.retry_after)
        return Refusal.of(E.OVERLOADED, str(exc))
    if isinstance(exc, ReaderReplaced):
        return Refusal.of(E.FORBIDDEN, str(exc))
    if isinstance(exc, UnknownModel):
        return Refusal.of(E.NOT_FOUND, str(exc), param="model")
    if isinstance(exc, StreamNotFound):  # EventsTrimmed too
        return Refusal.of(E.NOT_FOUND, str(exc) or NO_SUCH_STREAM)
    if isinstance(exc, StreamForbidden):
        return Refusal.of(E.FORBIDDEN, str(exc))
    if isinstance(exc, BadOffset):
        return Refusal.of(E.BAD_REQUEST, str(exc), param="after")
    if isinstance(exc, RedisFull):  # a write refused (Redis at maxmemory): not an outage
        return Refusal(E.OVERLOADED, STORE_FULL, retry_after=FULL_RETRY_AFTER)
    message = STORE_UNREACHABLE_RESUME if streaming else STORE_UNREACHABLE
    return Refusal.of(E.UNAVAILABLE, message)
