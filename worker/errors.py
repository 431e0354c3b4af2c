"""The worker's exceptions, in one place: an engine's refusal, and the relay's failures.

- :class:`EngineRefused`: an engine will not run a request (its code is what the client
  gets).
- The relay (worker/upstream/): :class:`UpstreamError` and its kinds, by when they happen
  and whether another attempt may help (worker/upstream/failures.py decides); the HTTP
  client's :class:`TransportError` s (worker/upstream/client.py); :class:`MalformedHttp`,
  bytes that are not an HTTP/1.x response (worker/upstream/http1.py). Sans I/O.
"""

from __future__ import annotations

from tokenrelay.core.wire.vocabulary import ErrorCode

__all__ = [
    "Broken",
    "ConnectError",
    "ConnectTimeout",
    "EngineRefused",
    "MalformedHttp",
    "PoolTimeout",
    "ReadTimeout",
    "Refused",
    "RemoteProtocolError",
    "Retryable",
    "TransportError",
    "UpstreamError",
    "WriteTimeout",
]


class EngineRefused(Exception):
    """An engine will not run a request; ``code`` is the protocol error code clients get
    (core/wire/errors.py: ``unavailable``, ``overloaded``, ``bad_request``, ...)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message


class UpstreamError(Exception):
    """An upstream call failed; ``code`` is a protocol error code (core/wire/errors.py)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Retryable(UpstreamError):
    """A failure before the first token that another attempt may not meet."""

    def __init__(self, code: ErrorCode, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(code, message)
        self.retry_after = retry_after  # the upstream's Retry-After, in seconds


class Refused(UpstreamError):
    """A failure before the first token that another attempt would meet again."""


class Broken(UpstreamError):
    """A failure after the first token: the stream ends with ``error``."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INTERNAL, message)


class TransportError(Exception):
    """The exchange with the upstream failed below HTTP (connect, read, write, framing)."""


class ConnectError(TransportError):
    """The connection (or its TLS handshake) could not be made."""


class ConnectTimeout(ConnectError):
    """Connecting took longer than ``connect_timeout``."""


class PoolTimeout(TransportError):
    """No connection of the pool came free within ``timeout``."""


class WriteTimeout(TransportError):
    """The request could not be sent within ``timeout``."""


class ReadTimeout(TransportError):
    """Nothing arrived for ``timeout`` seconds while an answer was awaited."""


class RemoteProtocolError(TransportError):
    """The connection closed in the middle of an answer, or the answer was not HTTP."""


class MalformedHttp(Exception):
    """The peer sent something that is not an HTTP/1.x response the relay can read."""
