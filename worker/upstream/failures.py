"""What can go wrong with an upstream call, and when to try it again.

Where in the call it happens decides what the client sees:

- before the first token, a transient failure (connection refused or reset, a
  5xx, a 429, a connection cut before any text) is :class:`Retryable`: the call
  is made again after a backoff (:class:`RetryPolicy`); when the attempts
  run out the stream is refused with the error's ``code`` (``unavailable``,
  ``overloaded`` for a 429) as a ``rejected`` marker, and the gateway answers
  it as it answers its own refusals (a WebSocket ``error`` frame, an HTTP 503);
- before the first token, an answer that will not change on a retry (a 400,
  a 413, a key the upstream refuses) is :class:`Refused` at once;
- after the first token, anything is :class:`Broken`: the stream ends with
  ``done`` ``error`` and the message, its text so far kept and resumable.

Every error carries the protocol code clients get (core/wire/errors.py) and a
one-line message that names the upstream's own words where it sent some.

**Retries.** Attempts are made only before the call's first token: a call that has
streamed text is never made again, since the upstream would generate a different
continuation. Delays double from :data:`FIRST_DELAY` up to
:data:`MAX_DELAY` with jitter, so many calls refused at once do not come back at
once; a 429's (or 503's) ``Retry-After`` is honoured up to :data:`MAX_RETRY_AFTER`.
The whole budget stays within a few seconds, near the time an HTTP client waits
for the gateway's verdict before the stream starts (gateway/http/openai.py).
"""

from __future__ import annotations

import email.utils
import math
import random
import time

MAX_ATTEMPTS = 4  # the first attempt and three more
FIRST_DELAY = 0.25  # seconds
MAX_DELAY = 2.0
MAX_RETRY_AFTER = 10.0  # a longer Retry-After is cut to this
JITTER = 0.2  # +-20%


def parse_retry_after(raw: str | None, *, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date); None if absent/bad."""
    if not raw:
        return None
    raw = raw.strip()
    try:
        seconds = float(raw)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


class RetryPolicy:
    """The delays of one call's attempts (one instance per call)."""

    def __init__(
        self,
        *,
        max_attempts: int = MAX_ATTEMPTS,
        first: float = FIRST_DELAY,
        cap: float = MAX_DELAY,
        rng: random.Random | None = None,
    ) -> None:
        self.max_attempts = max_attempts
        self.first, self.cap = first, cap
        self.attempts = 0  # made so far
        self._rng = rng or random.Random()

    def next_delay(self, retry_after: float | None = None) -> float | None:
        """An attempt failed: seconds to wait before the next, or None to give up."""
        self.attempts += 1
        if self.attempts >= self.max_attempts:
            return None
        delay = min(self.cap, self.first * 2 ** (self.attempts - 1))
        delay *= 1 + self._rng.uniform(-JITTER, JITTER)
        if retry_after is not None:
            delay = max(delay, min(retry_after, MAX_RETRY_AFTER))
        return delay
