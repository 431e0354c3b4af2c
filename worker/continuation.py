"""Continuing a stream whose worker died: what its log says, and whether it can go on.

A worker that takes over a running stream (its worker's heartbeat expired; the request
entry was claimed, worker/store.py) first makes itself the stream's owner
(:data:`~core.wire.scripts.TAKEOVER_LUA`: from then on the old worker's writes are
refused, should it only have been paused), then reads the log. Every token event names
the engine tokens whose text it carries (the ``i`` field, core/wire/events.py), so the
sequence is rebuilt exactly: the prompt (tokenized again from the request body) and the
tokens already streamed are prefilled, and generation goes on from the next seq. Tokens
sampled after the last event (their text held back: an incomplete character, a possible
stop string) are not in the log; the new worker samples them again, which gives the same
tokens for greedy and seeded requests.

:func:`plan` decides from the log alone; :func:`take_over`, :func:`read_log` and
:func:`finish_foreign` are the Redis calls around it; worker/intake.py acts on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenrelay.core.wire.events import DONE, TOKEN, F, decode_ids, plan_finish, seq_of
from tokenrelay.core.wire.records import MetaField as M
from tokenrelay.core.wire.records import text
from tokenrelay.core.wire.scripts import TAKEOVER_LUA
from tokenrelay.core.wire.vocabulary import FinishReason, StreamStatus
from tokenrelay.worker.store import Batch, WorkerStore

MAX_TAKEOVERS = 3  # a stream taken over more often ends with `error` (a request that kills
# every worker it runs on must not crash-loop the fleet; below serve's crash budget, 5)


@dataclass
class Continuation:
    """A running stream's log, as a new worker goes on with it."""

    events: list[list[str]]  # every event as stored (flat fields), index = seq
    token_ids: list[int] = field(default_factory=list)  # the generated tokens in the log
    text: list[str] = field(default_factory=list)  # the completion text so far, by event
    takeovers: int = 0  # this takeover included

    @property
    def text_chars(self) -> int:
        return sum(len(t) for t in self.text)


def plan(entries: list[tuple[int, list[str]]], takeovers: int) -> Continuation | str:
    """The :class:`Continuation` of a log (``(seq, flat fields)`` entries in order), or
    why it cannot continue: ``"done"`` when it already ended, else a message for the
    stream's ``error`` (a log written before token ids were recorded, a gap, too many
    takeovers)."""
    if takeovers > MAX_TAKEOVERS:
        return (
            f"the stream's worker stopped {takeovers} times while running it (each time "
            f"another worker took it over); not continued again"
        )
    out = Continuation(events=[], takeovers=takeovers)
    for seq, flat in entries:
        if seq != len(out.events):
            return f"its log has a gap at seq {len(out.events)}"
        fields = dict(zip(flat[0::2], flat[1::2], strict=False))
        kind = fields.get(F.KIND)
        if kind == DONE:
            return "done"
        if kind == TOKEN:
            ids = fields.get(F.TOKEN_IDS)
            if ids is None:
                return "its log has no token ids to continue from"
            try:
                out.token_ids += decode_ids(ids)
            except ValueError:
                return "its log has malformed token ids"
            out.text.append(fields.get(F.TEXT, ""))
        out.events.append(list(flat))
    if not out.events:
        return "its log is empty"
    return out


# --- the stream in Redis (blocking, the worker loop's thread) --------------------------


def take_over(store: WorkerStore, stream_id: str, old_worker: str) -> int:
    """Own a running stream whose worker ``old_worker`` is dead (:data:`TAKEOVER_LUA`):
    its takeovers so far, 0 when it no longer runs under that worker."""
    key = store.keys.meta(stream_id)
    return int(store.redis.eval(TAKEOVER_LUA, 1, key, old_worker, store.worker_id))


def read_log(store: WorkerStore, stream_id: str) -> list[tuple[int, list[str]]]:
    """A stream's whole log: ``(seq, flat fields)`` per event, in order."""
    entries: Any = store.redis.xrange(store.keys.stream(stream_id))
    return [
        (seq_of(eid), [text(x) for kv in fields.items() for x in kv]) for eid, fields in entries
    ]


def finish_foreign(store: WorkerStore, stream_id: str, reason: FinishReason, message: str) -> bool:
    """End a stream this worker does not run (its worker died); race-safe."""
    for _ in range(5):
        pipe = store.redis.pipeline(transaction=False)
        pipe.xrevrange(store.keys.stream(stream_id), count=1)
        pipe.hmget(store.keys.meta(stream_id), M.STATUS, M.PROMPT_TOKENS, M.STREAM_TTL)
        top, (st, pt, ttl) = pipe.execute()
        if st is None or text(st) == StreamStatus.DONE:
            return False
        last = seq_of(top[0][0]) if top else -1
        first, events = plan_finish(last, int(pt or 0), reason, message)
        batch = Batch(stream_id, first, events, {M.FINISH_REASON: reason}, float(ttl or 3600.0))
        res = store.flush([batch])[0]
        if res is None:
            raise ConnectionError("the stream's redis master is down")
        if res.status == 1:
            return True
        if res.status != 0:
            return False
    return False
