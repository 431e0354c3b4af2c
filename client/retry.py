"""The retry policy of the Python client, sans I/O: which refusals are retried, and when.

A refused ``generate`` or ``resume`` whose code is retryable (``unavailable``,
``overloaded``, ``rate_limited``: docs/protocol.md, "`error`") is sent again after the
server's ``retry_after`` (or the code's default hint from the protocol's error table) plus
a jittered exponential backoff, so that clients refused together do not all come back in
the same millisecond. Reconnects after a lost socket wait the backoff alone.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenrelay.core.wire.errors import lookup
from tokenrelay.core.wire.vocabulary import ErrorCode

__all__ = ["RETRYABLE_CODES", "RetryPolicy"]

# what a client sends again with backoff; every other code ends the stream with its error
RETRYABLE_CODES = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.OVERLOADED, ErrorCode.RATE_LIMITED})


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently the client retries (all times in seconds).

    ``limit`` bounds both the retries of one refused request (reset once it starts or
    resumes) and the reconnect attempts in a row; a ``retry_after`` above ``max_delay``
    is not waited for: the error is raised instead.
    """

    limit: int = 8
    max_delay: float = 30.0
    initial: float = 0.25
    maximum: float = 10.0
    factor: float = 2.0
    jitter: float = 0.5  # each delay is drawn from [d * (1 - jitter), d]
    random: Callable[[], float] = field(default=random.random, compare=False, repr=False)

    def backoff(self, attempt: int) -> float:
        """The delay before attempt ``attempt`` (0: the first retry), jittered."""
        base = min(self.maximum, self.initial * self.factor ** max(0, attempt))
        jitter = min(1.0, max(0.0, self.jitter))
        return base * (1.0 - jitter * self.random())

    def retry_delay(self, attempt: int, code: str, retry_after: float | None) -> float | None:
        """The delay before retry number ``attempt`` (1: the first) of a request refused with
        ``code``; None when it is not to be retried (not retryable, over the limit, or a
        ``retry_after`` longer than ``max_delay``)."""
        if code not in RETRYABLE_CODES or attempt > self.limit:
            return None
        server = retry_after if retry_after is not None else lookup(code).retry_after
        server = max(0.0, server or 0.0)
        if server > self.max_delay:
            return None
        return server + self.backoff(attempt - 1)
