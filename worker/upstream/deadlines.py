"""One upstream attempt's deadlines: its response headers, its first text, its end.

``--upstream-timeout`` bounds each silence between two reads, so an upstream that
keeps talking without saying anything (a header trickled a byte at a time,
keep-alive comments instead of tokens, an answer that never ends) never meets it.
Three deadlines do, all counted from the moment the attempt's request goes out
(worker/upstream/config.py has their defaults):

- ``head_timeout``: the response headers are in (informational ``1xx`` answers do
  not count);
- ``first_token_timeout``: the first text is in (a queue and a prefill upstream);
- ``total_timeout``: the answer is over.

:class:`Deadlines` is one :func:`asyncio.timeout_at` scope per attempt, moved on as the
attempt gets further (one timer, not one per read); :meth:`Deadlines.missed` is the
error a missed one gives: before the first text the stream is refused with
``unavailable`` (no retry: a slow upstream stays slow), after it the stream ends with
``error`` and keeps the text so far.
"""

from __future__ import annotations

import asyncio

from tokenrelay.core.wire.vocabulary import ErrorCode
from tokenrelay.worker.errors import Broken, Refused, UpstreamError
from tokenrelay.worker.upstream.config import UpstreamConfig

HEADERS, TEXT, END = "headers", "text", "end"  # what an attempt waits for


class Deadlines:
    """The deadlines of one attempt; :meth:`scope` wraps the whole exchange."""

    def __init__(self, cfg: UpstreamConfig) -> None:
        self.cfg = cfg
        self.waiting = HEADERS
        self._begun = 0.0  # the loop's clock when the request went out
        self._scope: asyncio.Timeout | None = None

    def scope(self) -> asyncio.Timeout:
        """The timeout scope of an attempt whose request goes out now (its headers due)."""
        self._begun = asyncio.get_running_loop().time()
        self.waiting = HEADERS
        self._scope = asyncio.timeout_at(self._begun + self.cfg.head_timeout)
        return self._scope

    def headers_in(self) -> None:
        """The headers are in: now the first text is due."""
        self._move(TEXT, self.cfg.first_token_timeout)

    def text_in(self) -> None:
        """The first text is in: now the answer's end is due."""
        self._move(END, self.cfg.total_timeout)

    def _move(self, what: str, seconds: float) -> None:
        self.waiting = what
        if self._scope is not None:
            self._scope.reschedule(self._begun + seconds)

    def missed(self) -> UpstreamError:
        """The error of the deadline the scope's ``TimeoutError`` says was missed."""
        cfg = self.cfg
        if self.waiting == HEADERS:
            said = f"upstream sent no response headers within {cfg.head_timeout:g} s"
            return Refused(ErrorCode.UNAVAILABLE, said)
        if self.waiting == TEXT:
            said = f"upstream sent no text within {cfg.first_token_timeout:g} s"
            return Refused(ErrorCode.UNAVAILABLE, said)
        said = f"upstream answer not over within {cfg.total_timeout:g} s; the answer is cut short"
        return Broken(said)
