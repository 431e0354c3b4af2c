"""Who resumes each stream through this gateway: a cap per stream, and who gives way.

Every resume (WebSocket and gRPC ``resume`` frames, SSE ``GET /v1/streams/{id}/events``)
takes a :class:`Seat` of its stream here for as long as it reads, at most
``--max-resumes-per-stream`` at once (the request that started the stream is not
counted). A resume that finds its stream's seats taken replaces the oldest reader: a
client whose old socket is half-open (dead, but not noticed yet) always gets back in,
and the old reader ends with :class:`gateway.errors.ReaderReplaced`. Only a reader
that has held its seat for :data:`REPLACE_AFTER` seconds gives way, so a burst of
resumes arriving together (a flood: every one presents the same, right token) finds
young readers only and gets :class:`gateway.errors.TooManyReaders` (``overloaded``,
with the seconds until the oldest may be replaced as its ``retry_after``).

One registry per gateway process (``gateway.state.Gateway.readers``): the count is of
this process' readers; other gateways keep their own. Sans Redis: a dict of lists.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenrelay.core import options
from tokenrelay.gateway.errors import TooManyReaders

log = logging.getLogger("tokenrelay.gateway")

REPLACE_AFTER = 2.0  # seconds a reader holds its seat before a newer resume may take it
REPLACED = "a newer resume of this stream took this reader's place"  # ReaderReplaced's message


@dataclass(eq=False)
class Seat:
    """One reader of one stream: held from its resume until it stops reading."""

    stream_id: str
    since: float  # when it was taken (the registry's clock)
    on_replaced: Callable[[], None] = field(repr=False)  # ends the reader
    replaced: bool = False  # a newer resume took it: the reader must stop
    held: bool = True  # False once left or replaced


class StreamReaders:
    """The seats of every stream read through this gateway."""

    def __init__(
        self,
        limit: int = options.MAX_RESUMES_PER_STREAM,
        *,
        replace_after: float = REPLACE_AFTER,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"--max-resumes-per-stream must be an integer >= 1, got {limit!r}")
        if not replace_after >= 0:
            raise ValueError(f"replace_after must be >= 0 seconds, got {replace_after!r}")
        self.limit = limit
        self.replace_after = replace_after
        self._clock = clock
        self._seats: dict[str, list[Seat]] = {}  # stream id -> seats, oldest first
        self.replaced = 0  # readers replaced by a newer resume (tests, debugging)

    def count(self, stream_id: str) -> int:
        """The seats of ``stream_id`` held now."""
        return len(self._seats.get(stream_id, ()))

    def take(self, stream_id: str, on_replaced: Callable[[], None]) -> Seat:
        """A seat for a new reader of ``stream_id``; raises :class:`TooManyReaders`.

        With every seat taken, the oldest reader gives way if it has read for
        :data:`REPLACE_AFTER` seconds: it is marked ``replaced`` and ``on_replaced``
        of it runs (synchronously: it must only start ending its reader).
        """
        now = self._clock()
        seats = self._seats.setdefault(stream_id, [])
        if len(seats) >= self.limit:
            oldest = seats[0]
            wait = oldest.since + self.replace_after - now
            if wait > 0:
                raise TooManyReaders(
                    f"this stream already has {len(seats)} readers here (at most "
                    f"{self.limit} at once); retry in {math.ceil(wait)} s",
                    retry_after=wait,
                )
            seats.pop(0)
            oldest.held = False
            oldest.replaced = True
            self.replaced += 1
            held = round(now - oldest.since, 3)
            extra = {"stream_id": stream_id, "held_s": held, "limit": self.limit}
            log.info("reader replaced by a newer resume", extra=extra)
            try:
                oldest.on_replaced()
            except Exception:  # the new reader gets in whatever the old one does
                log.exception("ending a replaced reader failed", extra={"stream_id": stream_id})
        seat = Seat(stream_id, now, on_replaced)
        seats.append(seat)
        return seat

    def leave(self, seat: Seat | None) -> None:
        """Give a seat back (idempotent; nothing for one that was replaced)."""
        if seat is None or not seat.held:
            return
        seat.held = False
        seats = self._seats.get(seat.stream_id)
        if seats is None:
            return
        try:
            seats.remove(seat)
        except ValueError:
            pass
        if not seats:
            del self._seats[seat.stream_id]
