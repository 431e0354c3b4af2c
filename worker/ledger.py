"""A worker settles the stream-log bytes of the streams it ends (core/wire/log_ledger.py).

A gateway reserved each stream's worst case in its owner's ledger; once a ``done``
event the worker wrote has landed, :meth:`LogLedger.ended` reads the stream's owner
(its metadata) and its log's size (``MEMORY USAGE``) in one round trip, and settles the
owner's entry: the log's size, held ``stream_ttl`` more, as long as the log lives. It
is best effort and never holds up the step loop for long: what could not be settled
(Redis, or on a cluster the master of the stream or of the ledger, not answering;
worker/outage.py leaves a down master alone for its backoff) is tried again after the
next append.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tokenrelay.core.redis.connection import is_outage, queue_script
from tokenrelay.core.wire.keys import Keys
from tokenrelay.core.wire.log_ledger import SETTLE_LUA, settle_call
from tokenrelay.core.wire.records import MetaField, text
from tokenrelay.worker.outage import Masters

log = logging.getLogger("tokenrelay.worker")

MAX_WAITING = 10_000  # streams kept to settle later; beyond, their reservations lapse

# one unit of a round trip: (a key of the slot it runs in, what it queues, how many commands)
Job = tuple[str, Callable[[Any], object], int]


class LogLedger:
    """The settles of one worker (``masters``: on a cluster)."""

    def __init__(self, redis: Any, keys: Keys, masters: Masters | None) -> None:
        self.redis = redis
        self.keys = keys
        self.masters = masters
        self.waiting: list[tuple[str, float]] = []  # (stream id, seconds its log stays)

    def ended(self, streams: list[tuple[str, float]]) -> None:
        """Settle ``streams`` (and those left from before): ``(stream id, stream_ttl)``."""
        todo, self.waiting = (self.waiting + streams)[-MAX_WAITING:], []
        if not todo:
            return
        try:
            self._settle(todo)
        except Exception as exc:
            if not is_outage(exc):
                raise
            self.waiting = todo
            log.debug("stream log bytes not settled yet: %r", exc)

    def _settle(self, todo: list[tuple[str, float]]) -> None:
        looks: list[Job] = []
        for sid, _ in todo:
            log_key = self.keys.stream(sid)

            def look(pipe: Any, sid: str = sid, log_key: str = log_key) -> None:
                pipe.hget(self.keys.meta(sid), MetaField.LOG_OWNER)
                pipe.memory_usage(log_key, 0)

            looks.append((log_key, look, 2))
        settles: list[Job] = []
        todo_settled: list[tuple[str, float]] = []
        for (sid, ttl), got in zip(todo, self._run(looks), strict=True):
            if got is None:  # its master does not answer
                self.waiting.append((sid, ttl))
            elif got[0] and not isinstance(got[0], Exception):  # an owner's ledger counts it
                size = got[1] if isinstance(got[1], int) else 0
                keys, args = settle_call(self.keys, text(got[0]), sid, size, ttl)

                def settle(pipe: Any, keys: list[str] = keys, args: list[str] = args) -> None:
                    queue_script(pipe, SETTLE_LUA, keys, args)

                settles.append((keys[0], settle, 1))
                todo_settled.append((sid, ttl))
        for item, got in zip(todo_settled, self._run(settles), strict=True):
            if got is None:  # the ledger's master does not answer
                self.waiting.append(item)

    def _run(self, jobs: list[Job]) -> list[list[Any] | None]:
        """Each job's replies, one pipeline per master (one in all on one Redis); ``None``
        for the jobs of a master that does not answer."""
        groups: dict[str, list[int]] = {}
        for i, (key, _, _) in enumerate(jobs):
            groups.setdefault(self.masters.of_key(key) if self.masters else "", []).append(i)
        out: list[list[Any] | None] = [None] * len(jobs)
        for master, mine in groups.items():

            def fill(pipe: Any, mine: list[int] = mine) -> None:
                for i in mine:
                    jobs[i][1](pipe)

            if self.masters is None:
                pipe = self.redis.pipeline(transaction=False)
                fill(pipe)
                replies: list[Any] | None = pipe.execute(raise_on_error=False)
            else:
                replies = self.masters.run(master, fill)
            if replies is None:
                continue
            at = 0
            for i in mine:
                out[i] = list(replies[at : at + jobs[i][2]])
                at += jobs[i][2]
        return out
