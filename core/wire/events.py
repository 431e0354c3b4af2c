"""The events of a stream log: how each is stored in Redis and decoded from it.

Each entry of ``P s:{stream_id}`` (core/wire/keys.py) is one event; its entry
id *is* its offset (seq ``n`` has id ``n-1``). Field names are one letter so
entries stay small. :data:`FINISH_REASONS` are the ``done`` event's reasons.

Fields are only ever added, and optional: a reader ignores the fields it does
not know (a token event's ``l``, its logprobs, core/wire/logprobs.py, is one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FINISH_REASONS = ("stop", "length", "tool_calls", "cancelled", "error", "expired")


def entry_id(seq: int) -> str:
    return f"{seq}-1"


def seq_of(entry_id: bytes | str) -> int:
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-", 1)[0])


# Event kinds as stored (one letter keeps entries small).
ACCEPTED, TOKEN, DONE, REJECTED = "a", "t", "d", "x"


@dataclass(slots=True)
class Event:
    """One entry of a stream's log, decoded.

    ``kind`` is ``accepted`` (seq 0: a worker took the request), ``rejected``
    (seq 0: the worker refused it; ``code``/``message`` say why), ``token``
    (``text``; ``logprobs``, the stored ``l`` field, when the request asked for
    them) or ``done`` (``finish_reason``, usage, ``message`` for errors, the
    ``tool_calls`` made when the request offered tools).
    """

    seq: int
    kind: str
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    code: str | None = None
    message: str | None = None
    worker: str | None = None
    logprobs: str | None = None  # as stored: core.wire.logprobs.decode_logprobs reads it
    tool_calls: str | None = None  # a done event's calls as stored (core.wire.tools.decode_calls)


_KIND_NAMES = {ACCEPTED: "accepted", TOKEN: "token", DONE: "done", REJECTED: "rejected"}


def _s(value: Any) -> str:
    return value.decode("utf-8", "surrogatepass") if isinstance(value, bytes) else str(value)


def decode_event(eid: bytes | str, fields: dict[Any, Any]) -> Event:
    """Build an :class:`Event` from one stream entry (bytes or str fields)."""
    return event_from_fields(seq_of(eid), {_s(k): _s(v) for k, v in fields.items()})


def event_from_fields(seq: int, f: dict[str, str]) -> Event:
    """Build the :class:`Event` with seq ``seq`` from its stored fields."""
    kind = _KIND_NAMES.get(f.get("k", ""), "unknown")
    return Event(
        seq=seq,
        kind=kind,
        text=f.get("x", ""),
        finish_reason=f.get("r"),
        prompt_tokens=int(f.get("pt", 0) or 0),
        completion_tokens=int(f.get("n", 0) or 0),
        code=f.get("c"),
        message=f.get("m"),
        worker=f.get("w"),
        logprobs=f.get("l"),
        tool_calls=f.get("tc"),
    )


def token_fields(text: str, logprobs: str | None = None) -> list[str]:
    """A token event; ``logprobs``: its ``l`` field (core.wire.logprobs.encode_logprobs)."""
    if logprobs is None:
        return ["k", TOKEN, "x", text]
    return ["k", TOKEN, "x", text, "l", logprobs]


def accepted_fields(prompt_tokens: int, worker: str) -> list[str]:
    return ["k", ACCEPTED, "pt", str(prompt_tokens), "w", worker]


def rejected_fields(code: str, message: str) -> list[str]:
    return ["k", REJECTED, "c", code, "m", message]


def done_fields(
    reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    message: str | None = None,
    tool_calls: str | None = None,
) -> list[str]:
    """A done event; ``tool_calls``: its ``tc`` field (core.wire.tools.encode_calls)."""
    out = ["k", DONE, "r", reason, "pt", str(prompt_tokens), "n", str(completion_tokens)]
    if message:
        out += ["m", message]
    if tool_calls:
        out += ["tc", tool_calls]
    return out


def plan_finish(
    last_seq: int, prompt_tokens: int, reason: str, message: str | None
) -> tuple[int, list[list[str]]]:
    """``(first_seq, events)`` that end a stream from outside its worker.

    A stream that never ran (empty log) gets a seq-0 ``rejected`` marker saying
    why, then ``done`` at seq 1; otherwise ``done`` follows the last event.
    ``completion_tokens`` counts the token events written so far.
    """
    done = done_fields(reason, prompt_tokens, max(0, last_seq), message)
    if last_seq < 0:
        code = "cancelled" if reason == "cancelled" else "unavailable"
        return 0, [rejected_fields(code, message or reason), done]
    return last_seq + 1, [done]
