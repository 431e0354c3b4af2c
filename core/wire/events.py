"""The events of a stream log: how each is stored in Redis and decoded from it.

Each entry of ``P s:{stream_id}`` (core/wire/keys.py) is one event; its entry
id *is* its offset (seq ``n`` has id ``n-1``). Field names are one letter so
entries stay small (:class:`F` names them); the kinds, finish reasons and codes are
the enums of core/wire/vocabulary.py.

Fields are only ever added, and optional: a reader ignores the fields it does
not know (a token event's ``l``, its logprobs, core/wire/logprobs.py, is one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenrelay.core.wire.vocabulary import ErrorCode, EventKind, FinishReason, StoredKind

FINISH_REASONS = tuple(FinishReason)


class F:
    """The fields of a stream-log entry, as stored."""

    KIND = "k"  # a StoredKind
    TEXT = "x"  # a token event's text
    LOGPROBS = "l"  # a token event's logprobs (core/wire/logprobs.py)
    REASON = "r"  # a done event's FinishReason
    PROMPT_TOKENS = "pt"
    COMPLETION_TOKENS = "n"
    CODE = "c"  # a rejected event's ErrorCode (or "cancelled")
    MESSAGE = "m"
    WORKER = "w"  # an accepted event's worker id
    TOOL_CALLS = "tc"  # a done event's calls (core/wire/tools.py)
    TOKEN_IDS = "i"  # a token event's token ids, space-separated (see encode_ids)
    CONTENT = "v"  # a token event's content, where it is not its text (tool calls)
    CALL_DELTAS = "d"  # a token event's tool-call deltas (core/wire/tools.py encode_deltas)


def entry_id(seq: int) -> str:
    return f"{seq}-1"


def seq_of(entry_id: bytes | str) -> int:
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-", 1)[0])


# Event kinds as stored (one letter keeps entries small).
ACCEPTED, TOKEN, DONE, REJECTED = (
    StoredKind.ACCEPTED,
    StoredKind.TOKEN,
    StoredKind.DONE,
    StoredKind.REJECTED,
)


@dataclass(slots=True)
class Event:
    """One entry of a stream's log, decoded.

    ``kind`` is ``accepted`` (seq 0: a worker took the request), ``rejected``
    (seq 0: the worker refused it; ``code``/``message`` say why), ``token``
    (``text``; ``logprobs``, the stored ``l`` field, when the request asked for
    them) or ``done`` (``finish_reason``, usage, ``message`` for errors, the
    ``tool_calls`` made when the request offered tools).

    With tools offered, a token event's ``text`` is what the model wrote (call markup
    included: a continuation reads it back) and :attr:`shown` what clients see as
    content; ``call_deltas`` are the tool-call pieces it carries.
    """

    seq: int
    kind: EventKind
    text: str = ""
    finish_reason: str | None = None  # a FinishReason (as stored: one this version knows)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    code: str | None = None
    message: str | None = None
    worker: str | None = None
    logprobs: str | None = None  # as stored: core.wire.logprobs.decode_logprobs reads it
    tool_calls: str | None = None  # a done event's calls as stored (core.wire.tools.decode_calls)
    content: str | None = None  # a token event's content where it differs from ``text``
    call_deltas: str | None = None  # as stored: core.wire.tools.decode_deltas reads it

    @property
    def shown(self) -> str:
        """A token event's content: the text clients see."""
        return self.text if self.content is None else self.content


_KIND_NAMES: dict[str, EventKind] = {
    StoredKind.ACCEPTED: EventKind.ACCEPTED,
    StoredKind.TOKEN: EventKind.TOKEN,
    StoredKind.DONE: EventKind.DONE,
    StoredKind.REJECTED: EventKind.REJECTED,
}


def _s(value: Any) -> str:
    return value.decode("utf-8", "surrogatepass") if isinstance(value, bytes) else str(value)


def decode_event(eid: bytes | str, fields: dict[Any, Any]) -> Event:
    """Build an :class:`Event` from one stream entry (bytes or str fields)."""
    return event_from_fields(seq_of(eid), {_s(k): _s(v) for k, v in fields.items()})


def event_from_fields(seq: int, f: dict[str, str]) -> Event:
    """Build the :class:`Event` with seq ``seq`` from its stored fields."""
    kind = _KIND_NAMES.get(f.get(F.KIND, ""), EventKind.UNKNOWN)
    return Event(
        seq=seq,
        kind=kind,
        text=f.get(F.TEXT, ""),
        finish_reason=f.get(F.REASON),
        prompt_tokens=int(f.get(F.PROMPT_TOKENS, 0) or 0),
        completion_tokens=int(f.get(F.COMPLETION_TOKENS, 0) or 0),
        code=f.get(F.CODE),
        message=f.get(F.MESSAGE),
        worker=f.get(F.WORKER),
        logprobs=f.get(F.LOGPROBS),
        tool_calls=f.get(F.TOOL_CALLS),
        content=f.get(F.CONTENT),
        call_deltas=f.get(F.CALL_DELTAS),
    )


def token_fields(
    text: str,
    logprobs: str | None = None,
    token_ids: list[int] | None = None,
    *,
    content: str | None = None,
    calls: str | None = None,
) -> list[str]:
    """A token event; ``logprobs``: its ``l`` field (core.wire.logprobs.encode_logprobs);
    ``token_ids``: the engine tokens whose text it carries (its ``i`` field); ``content``:
    the content it shows where that is not ``text`` (its ``v`` field); ``calls``: its
    tool-call deltas (``d``, core.wire.tools.encode_deltas)."""
    out = [F.KIND, TOKEN, F.TEXT, text]
    if logprobs is not None:
        out += [F.LOGPROBS, logprobs]
    if token_ids is not None:
        out += [F.TOKEN_IDS, encode_ids(token_ids)]
    if content is not None:
        out += [F.CONTENT, content]
    if calls is not None:
        out += [F.CALL_DELTAS, calls]
    return out


def encode_ids(token_ids: list[int]) -> str:
    """The ``i`` field: decimal token ids separated by spaces ("" for none).

    A token event carries the ids of every token sampled since the previous token event:
    zero or several (a token whose text is held back, an incomplete character or a
    possible stop string, goes with the next event). A worker that continues the stream
    rebuilds the sequence from them (worker/continuation.py).
    """
    return " ".join(map(str, token_ids))


def decode_ids(raw: str) -> list[int]:
    """The token ids of an ``i`` field; ``ValueError`` for a malformed one."""
    return [int(t) for t in raw.split()]


def accepted_fields(prompt_tokens: int, worker: str) -> list[str]:
    return [F.KIND, ACCEPTED, F.PROMPT_TOKENS, str(prompt_tokens), F.WORKER, worker]


def rejected_fields(code: ErrorCode | FinishReason, message: str) -> list[str]:
    """A seq-0 refusal: an error ``code``, or ``cancelled`` before it started."""
    return [F.KIND, REJECTED, F.CODE, code, F.MESSAGE, message]


def done_fields(
    reason: FinishReason,
    prompt_tokens: int,
    completion_tokens: int,
    message: str | None = None,
    tool_calls: str | None = None,
) -> list[str]:
    """A done event; ``tool_calls``: its ``tc`` field (core.wire.tools.encode_calls)."""
    out = [F.KIND, DONE, F.REASON, reason, F.PROMPT_TOKENS, str(prompt_tokens),
           F.COMPLETION_TOKENS, str(completion_tokens)]  # fmt: skip
    if message:
        out += [F.MESSAGE, message]
    if tool_calls:
        out += [F.TOOL_CALLS, tool_calls]
    return out


def plan_finish(
    last_seq: int, prompt_tokens: int, reason: FinishReason, message: str | None
) -> tuple[int, list[list[str]]]:
    """``(first_seq, events)`` that end a stream from outside its worker.

    A stream that never ran (empty log) gets a seq-0 ``rejected`` marker saying
    why, then ``done`` at seq 1; otherwise ``done`` follows the last event.
    ``completion_tokens`` counts the token events written so far.
    """
    done = done_fields(reason, prompt_tokens, max(0, last_seq), message)
    if last_seq < 0:
        cancelled = reason == FinishReason.CANCELLED
        code = FinishReason.CANCELLED if cancelled else ErrorCode.UNAVAILABLE
        return 0, [rejected_fields(code, message or reason), done]
    return last_seq + 1, [done]
