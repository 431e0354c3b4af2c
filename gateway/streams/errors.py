"""What a stream-store exception tells the client, the same on every transport.

:func:`refusal` maps the exceptions of :mod:`tokenrelay.gateway.streams.store`
(:class:`NoWorker` and :class:`ShuttingDown`, :class:`Overloaded`, :class:`UnknownModel`,
:class:`StreamNotFound`, :class:`StreamForbidden`, :class:`BadOffset`,
:class:`RedisFull`, :class:`RedisUnavailable`) to a protocol error code and message; the WebSocket
(gateway/ws/connection.py) makes an ``error`` frame of it, the HTTP API
(gateway/http/common.py) an OpenAI-style error body.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenrelay.core.wire.errors import (
    NO_SUCH_STREAM,
    STORE_FULL,
    STORE_UNREACHABLE,
    STORE_UNREACHABLE_RESUME,
)
from tokenrelay.gateway.streams.models import UnknownModel
from tokenrelay.gateway.streams.store import (
    BadOffset,
    NoWorker,
    Overloaded,
    RedisFull,
    RedisUnavailable,
    StreamForbidden,
    StreamNotFound,
)

__all__ = ["STORE_ERRORS", "Refusal", "refusal"]

STORE_ERRORS = (
    NoWorker,
    Overloaded,
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

    code: str
    message: str
    retry_after: float | None = None  # seconds
    param: str | None = None


def refusal(exc: BaseException, *, streaming: bool = False) -> Refusal:
    """The :class:`Refusal` for a stream-store exception (anything else: Redis is down).

    ``streaming``: the stream was already being delivered, so an outage tells the
    client to resume later.
    """
    if isinstance(exc, NoWorker):  # ShuttingDown too
        return Refusal("unavailable", str(exc), retry_after=2)
    if isinstance(exc, Overloaded):
        return Refusal("overloaded", str(exc), retry_after=1)
    if isinstance(exc, UnknownModel):
        return Refusal("not_found", str(exc), param="model")
    if isinstance(exc, StreamNotFound):  # EventsTrimmed too
        return Refusal("not_found", str(exc) or NO_SUCH_STREAM)
    if isinstance(exc, StreamForbidden):
        return Refusal("forbidden", str(exc))
    if isinstance(exc, BadOffset):
        return Refusal("bad_request", str(exc), param="after")
    if isinstance(exc, RedisFull):  # a write refused (Redis at maxmemory): not an outage
        return Refusal("overloaded", STORE_FULL, retry_after=FULL_RETRY_AFTER)
    message = STORE_UNREACHABLE_RESUME if streaming else STORE_UNREACHABLE
    return Refusal("unavailable", message, retry_after=2)
