"""A worker's appends to the stream log: every step's events of all its streams at once.

:meth:`Appender.flush` writes each stream's new events with the compare-and-set append
script (core/wire/scripts.py) and acknowledges the requests whose ``done`` event it
wrote. On one Redis that is one pipelined round trip. On a cluster each master gets its
own pipeline (an append call holds the streams of one master,
:data:`~core.wire.scripts.APPEND_CLUSTER_LUA`), so a master that is down holds up only
its own streams (worker/outage.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenrelay.core.redis.connection import queue_script
from tokenrelay.core.wire.events import DONE
from tokenrelay.core.wire.keys import GROUP, MAXLEN, Keys
from tokenrelay.core.wire.scripts import (
    APPEND_CLUSTER_LUA,
    APPEND_LUA,
    Append,
    AppendResult,
    append_call,
    append_groups,
    decode_append,
)
from tokenrelay.worker.ledger import LogLedger
from tokenrelay.worker.outage import Masters


@dataclass(frozen=True)
class Batch(Append):
    """A worker's :class:`Append`, with the request it finishes (if any)."""

    ack_entry: str | None = None  # acknowledge (and drop) this request once written
    ack_queue: str | None = None  # ... in this request queue (None: ``P requests``)


class Appender:
    """Appends and acknowledgements of one worker (``masters``: on a cluster)."""

    def __init__(self, redis: Any, keys: Keys, masters: Masters | None) -> None:
        self.redis = redis
        self.keys = keys
        self.masters = masters
        self._unacked: list[tuple[str, str]] = []  # (queue, entry): a master was down
        self.ledger = LogLedger(redis, keys, masters)  # the ended streams' log bytes

    def flush(self, batches: list[Batch]) -> list[AppendResult | None]:
        """Append every batch in one pipelined round trip; one result per batch: a few
        script calls of up to ``APPEND_CHUNK`` streams each, every call publishing what it
        wrote. On a cluster, one pipeline per master, each call of one master's streams:
        the batches of a master that does not answer get ``None`` (worker/outage.py).
        The streams whose ``done`` event landed are settled in their owner's ledger
        (worker/ledger.py)."""
        results = (
            self._flush_by_master(batches) if self.masters is not None else self._flush(batches)
        )
        ended = [
            (b.stream_id, b.done_ttl)
            for b, res in zip(batches, results, strict=True)
            if res is not None and res.status == 1 and b.events and b.events[-1][1] == DONE
        ]
        self.ledger.ended(ended)
        return results

    def _flush(self, batches: list[Batch]) -> list[AppendResult | None]:
        if not batches:
            return []
        pipe = self.redis.pipeline(transaction=False)
        groups = append_groups(self.keys, batches)
        for group in groups:
            keys, args = append_call(self.keys, [batches[i] for i in group], maxlen=MAXLEN)
            queue_script(pipe, APPEND_LUA, keys, args)
        acks: dict[str, list[str]] = {}
        for b in batches:
            if b.ack_entry:
                acks.setdefault(b.ack_queue or self.keys.requests, []).append(b.ack_entry)
        for key, ids in acks.items():
            pipe.xack(key, GROUP, *ids)
            pipe.xdel(key, *ids)
        replies = pipe.execute(raise_on_error=False)
        out: dict[int, AppendResult] = {}
        for group, raw in zip(groups, replies, strict=False):
            if isinstance(raw, Exception):
                raise raw
            out.update((i, decode_append(answer)) for i, answer in zip(group, raw, strict=True))
        return [out[i] for i in range(len(batches))]

    def _flush_by_master(self, batches: list[Batch]) -> list[AppendResult | None]:
        assert self.masters is not None
        masters = self.masters
        by_master: dict[str, list[list[int]]] = {}
        for group in append_groups(self.keys, batches, masters.of_slot):
            master = masters.of_key(self.keys.stream(batches[group[0]].stream_id))
            by_master.setdefault(master, []).append(group)
        out: list[AppendResult | None] = [None] * len(batches)
        for master, groups in by_master.items():

            def fill(pipe: Any, groups: list[list[int]] = groups) -> None:
                for group in groups:
                    keys, args = append_call(self.keys, [batches[i] for i in group], maxlen=MAXLEN)
                    script = APPEND_CLUSTER_LUA if len(group) > 1 else APPEND_LUA
                    queue_script(pipe, script, keys, args)

            replies = masters.run(master, fill)
            if replies is None:  # down: these streams keep their events for a later flush
                continue
            for group, raw in zip(groups, replies, strict=True):
                if isinstance(raw, Exception):
                    raise raw
                for i, answer in zip(group, raw, strict=True):
                    out[i] = decode_append(answer)
        for b, res in zip(batches, out, strict=True):
            if b.ack_entry and res is not None:
                self._unacked.append((b.ack_queue or self.keys.requests, b.ack_entry))
        if self._unacked:
            self._ack_by_master()
        return out

    def _ack_by_master(self) -> None:
        """Acknowledge (and drop) the finished requests whose done event is written, each
        queue on its master; those of a master that is down wait for the next flush."""
        assert self.masters is not None
        by_master: dict[str, dict[str, list[str]]] = {}
        for queue, entry in self._unacked:
            by_master.setdefault(self.masters.of_key(queue), {}).setdefault(queue, []).append(entry)
        self._unacked = []
        for master, queues in by_master.items():

            def fill(pipe: Any, queues: dict[str, list[str]] = queues) -> None:
                for queue, ids in queues.items():
                    pipe.xack(queue, GROUP, *ids)
                    pipe.xdel(queue, *ids)

            if self.masters.run(master, fill) is None:
                self._unacked += [(q, e) for q, ids in queues.items() for e in ids]
