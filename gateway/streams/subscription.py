"""One consumer's live view of one stream log: a bounded, gap-checked buffer.

Events reach a :class:`Subscription` two ways (gateway/streams/tailer.py drives both):

- *live*: every append is published on the ``events`` channel as it lands
  (core/wire/scripts.py), and :meth:`Subscription.offer` takes the published
  events that follow on from what it holds;
- *catch-up*: while a subscription is ``lagging`` (just subscribed, its buffer
  overflowed, or a published batch did not follow on from it), the tailer
  reads its log from Redis and :meth:`Subscription.push` takes the entries.

Invariant: the buffer always holds seqs ``last_seq - len(buffer) + 1 ..
last_seq`` with no gap; anything that cannot be taken in order is left in
the log (``lagging`` is set and ``missed`` counted) and read again from there.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from tokenrelay.core.wire.events import Event
from tokenrelay.gateway.errors import StreamNotFound

BUFFER_LIMIT = 256  # events buffered per subscriber, at most


class Subscription:
    """One consumer's live view of one stream (events with seq > ``last_seq``)."""

    def __init__(self, stream_id: str, key: str, last_seq: int) -> None:
        self.stream_id = stream_id
        self.key = key
        self.last_seq = last_seq
        self.buffer: deque[Event] = deque()
        self.error: BaseException | None = None
        self.quiet_since = time.monotonic()
        self.closed = False
        # when the oldest live-fed batch in the buffer was appended (epoch s, Redis'
        # clock); None for events read from the log. The tail takes it with the events.
        self.appended: float | None = None
        # Catch-up state: while lagging, the tailer reads the log for this subscriber.
        # ``missed`` counts published batches it could not take; a catch-up read only
        # ends the lag if none was missed while the read was in flight.
        self.lagging = True
        self.missed = 0
        self._ready = asyncio.Event()
        self._wake: Callable[[], None] = lambda: None

    def room(self) -> int:
        return BUFFER_LIMIT - len(self.buffer)

    def push(self, event: Event) -> bool:
        """Buffer ``event`` if it is the next one; False when it could not be taken.

        An event at or below ``last_seq`` is already held: True, nothing done.
        """
        if event.seq <= self.last_seq or self.closed:
            return True
        if len(self.buffer) >= BUFFER_LIMIT:
            return False
        if event.seq > self.last_seq + 1:  # only trimming (MAXLEN) can do this
            self.fail(StreamNotFound(f"events after seq {self.last_seq} are no longer kept"))
            return False
        self.buffer.append(event)
        self.last_seq = event.seq
        self.quiet_since = time.monotonic()
        self._ready.set()
        return True

    def offer(self, first_seq: int, events: list[Event], appended: float | None = None) -> None:
        """Take a published batch (seqs ``first_seq``..) as far as it follows on.

        A batch that starts past ``last_seq + 1`` (this subscriber is behind)
        or does not fit in the buffer is left to a catch-up read of the log.
        ``appended``: when the batch was appended (the delivery latency's start).
        """
        if self.closed or self.error is not None:
            return
        if first_seq + len(events) - 1 <= self.last_seq:
            return  # already held (read from the log first)
        if first_seq > self.last_seq + 1:
            self.mark_lagging()
            return
        for ev in events[self.last_seq + 1 - first_seq :]:
            if len(self.buffer) >= BUFFER_LIMIT:
                self.mark_lagging()
                return
            self.buffer.append(ev)
            self.last_seq = ev.seq
        if self.appended is None:
            self.appended = appended
        self.quiet_since = time.monotonic()
        self._ready.set()

    def mark_lagging(self) -> None:
        """Something may be in the log that this subscriber has not seen: read it."""
        self.missed += 1
        if not self.lagging:
            self.lagging = True
            self._wake()

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._ready.set()

    async def get(self) -> list[Event]:
        """Wait for events; returns all buffered ones (raises the failure, if any)."""
        while not self.buffer:
            if self.error is not None:
                raise self.error
            self._ready.clear()
            await self._ready.wait()
        out = list(self.buffer)
        self.buffer.clear()
        if self.lagging:
            self._wake()  # may have been left out of reads while full
        return out
