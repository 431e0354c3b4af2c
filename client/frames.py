"""Protocol v1 frames as the Python client sees them, sans I/O.

Client frames are built as plain dicts (:func:`generate_frame`, :func:`resume_frame`,
:func:`cancel_frame`) and serialised by :func:`encode`; a server frame's text becomes a
typed record (:func:`decode`). Decoding is lenient as docs/protocol.md asks of clients:
unknown fields are ignored, an unknown frame type (or a frame that is not a JSON object)
is an :class:`Unknown` the client skips, and an ill-typed field reads as its default.
The error codes and finish reasons are the protocol's enums (core/wire/vocabulary.py).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenrelay.core.wire.errors import as_code
from tokenrelay.core.wire.vocabulary import ErrorCode, FinishReason

__all__ = [
    "Cancelled",
    "Done",
    "ErrorFrame",
    "Hello",
    "Notice",
    "Pong",
    "Resumed",
    "ServerFrame",
    "Started",
    "Token",
    "ToolCallDelta",
    "Unknown",
    "Usage",
    "cancel_frame",
    "decode",
    "encode",
    "finish_reason",
    "generate_frame",
    "new_request_id",
    "resume_frame",
]

SHUTTING_DOWN = "shutting_down"  # the notice of a draining gateway
WORKER_READY = "worker_ready"  # the notice that an engine worker became ready


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished stream (the ``done`` frame's ``usage``)."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        """Prompt and completion together."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Hello:
    """The first frame on every socket."""

    protocol: int
    heartbeat_s: float | None
    max_frame_bytes: int | None
    server: str | None
    worker_ready: bool


@dataclass(frozen=True)
class Started:
    """A ``generate`` was taken: its stream's id and secret resume token."""

    request_id: str | None
    stream_id: str
    resume_token: str
    prompt_tokens: int | None
    index: int | None = None


@dataclass(frozen=True)
class ToolCallDelta:
    """One entry of a token frame's ``tool_calls`` (OpenAI's ``delta.tool_calls``): a call's
    first entry has its ``id`` and ``name``, every entry an ``arguments`` fragment (maybe
    ``""``); a call's fragments, in seq order, add up to its ``arguments``."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class Token:
    """One token event (``seq`` 1, 2, ...): its ``text`` (the content: ``""`` when it wrote
    call markup), the ``tool_calls`` deltas it carries (with ``params.tools``) and its
    ``logprobs`` (only when asked for)."""

    stream_id: str
    seq: int
    text: str
    logprobs: list[dict[str, Any]] | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class Done:
    """The last event of a stream."""

    stream_id: str
    seq: int | None
    finish_reason: FinishReason | str
    usage: Usage | None
    message: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Resumed:
    """The answer to ``resume``, before the replayed events."""

    stream_id: str
    after: int


@dataclass(frozen=True)
class Cancelled:
    """The answer to ``cancel``: ``cancelling`` (a ``done`` follows) or ``finished``."""

    stream_id: str
    state: str
    finish_reason: FinishReason | str | None


@dataclass(frozen=True)
class ErrorFrame:
    """An ``error``; with a ``stream_id`` this socket no longer delivers that stream."""

    code: ErrorCode
    message: str
    request_id: str | None = None
    stream_id: str | None = None
    retry_after: float | None = None


@dataclass(frozen=True)
class Notice:
    """Information, not an error: ``shutting_down`` (with ``drain_s``), ``worker_ready``."""

    code: str
    message: str
    drain_s: float | None = None


@dataclass(frozen=True)
class Pong:
    """The answer to ``ping``."""


@dataclass(frozen=True)
class Unknown:
    """A frame this client does not know (skipped: forward compatibility)."""

    raw: Any


ServerFrame = (
    Hello | Started | Token | Done | Resumed | Cancelled | ErrorFrame | Notice | Pong | Unknown
)


# --- client frames ---------------------------------------------------------------------


def new_request_id() -> str:
    """A fresh ``request_id`` (``r-`` and 18 hex digits)."""
    return f"r-{secrets.token_hex(9)}"


def generate_frame(
    *,
    messages: Sequence[Mapping[str, Any]] | None = None,
    prompt: str | None = None,
    params: Mapping[str, Any] | None = None,
    request_id: str | None = None,
    model: str | None = None,
    traceparent: str | None = None,
) -> dict[str, Any]:
    """A ``generate`` frame: ``messages`` (a chat) or ``prompt`` (raw text), exactly one.

    ``params`` are the protocol's sampling parameters as they are (the gateway checks
    them); ``n`` must be 1: a client stream is one choice.
    """
    if (messages is None) == (prompt is None):
        raise ValueError("give either messages or prompt")
    params = dict(params or {})
    if params.get("n", 1) != 1:
        raise ValueError("n must be 1 here: ask once per choice")
    params.pop("n", None)
    frame: dict[str, Any] = {"type": "generate", "request_id": request_id or new_request_id()}
    if messages is not None:
        frame["messages"] = [dict(m) for m in messages]
    else:
        frame["prompt"] = prompt
    if params:
        frame["params"] = params
    if model is not None:
        frame["model"] = model
    if traceparent is not None:
        frame["traceparent"] = traceparent
    return frame


def resume_frame(stream_id: str, resume_token: str, after: int) -> dict[str, Any]:
    """A ``resume``: replay the events with seq > ``after``, then tail live."""
    return {"type": "resume", "stream_id": stream_id, "resume_token": resume_token, "after": after}


def cancel_frame(stream_id: str, resume_token: str | None) -> dict[str, Any]:
    """A ``cancel`` (with the token it is accepted from any socket)."""
    frame: dict[str, Any] = {"type": "cancel", "stream_id": stream_id}
    if resume_token is not None:
        frame["resume_token"] = resume_token
    return frame


def encode(frame: Mapping[str, Any]) -> str:
    """A client frame as the text of one WebSocket frame (compact JSON, UTF-8 as is)."""
    return json.dumps(frame, separators=(",", ":"), ensure_ascii=False)


# --- server frames ---------------------------------------------------------------------


def _str(raw: Any) -> str | None:
    return raw if isinstance(raw, str) else None


def _int(raw: Any) -> int | None:
    return raw if isinstance(raw, int) and not isinstance(raw, bool) else None


def _num(raw: Any) -> float | None:
    ok = isinstance(raw, int | float) and not isinstance(raw, bool)
    return float(raw) if ok else None


def finish_reason(raw: Any) -> FinishReason | str:
    """A finish reason as its enum member (one this version does not know: as is)."""
    try:
        return FinishReason(raw)
    except ValueError:
        return str(raw)


def _usage(raw: Any) -> Usage | None:
    if not isinstance(raw, dict):
        return None
    return Usage(_int(raw.get("prompt_tokens")) or 0, _int(raw.get("completion_tokens")) or 0)


def _list_of_dicts(raw: Any) -> list[dict[str, Any]]:
    return [x for x in raw if isinstance(x, dict)] if isinstance(raw, list) else []


def _tool_deltas(raw: Any) -> tuple[ToolCallDelta, ...]:
    out = []
    for d in _list_of_dicts(raw):
        index, fn = _int(d.get("index")), d.get("function")
        if index is None or index < 0:
            continue
        fn = fn if isinstance(fn, dict) else {}
        args = _str(fn.get("arguments")) or ""
        out.append(ToolCallDelta(index, args, _str(d.get("id")), _str(fn.get("name"))))
    return tuple(out)


def decode(text: str | bytes) -> ServerFrame:
    """One server frame, typed; anything unexpected is :class:`Unknown`."""
    try:
        f = json.loads(text)
    except ValueError:
        return Unknown(text)
    if not isinstance(f, dict):
        return Unknown(f)
    kind, sid = f.get("type"), _str(f.get("stream_id"))
    if kind == "token" and sid and (seq := _int(f.get("seq"))) is not None:
        lp, text = f.get("logprobs"), _str(f.get("text")) or ""
        deltas = _tool_deltas(f.get("tool_calls"))
        return Token(sid, seq, text, _list_of_dicts(lp) if lp else None, deltas)
    if kind == "started" and sid and (token := _str(f.get("resume_token"))):
        pt, index = _int(f.get("prompt_tokens")), _int(f.get("index"))
        return Started(_str(f.get("request_id")), sid, token, pt, index)
    if kind == "done" and sid:
        reason = finish_reason(f.get("finish_reason") or FinishReason.STOP)
        calls = _list_of_dicts(f.get("tool_calls"))
        return Done(sid, _int(f.get("seq")), reason, _usage(f.get("usage")),
                    _str(f.get("message")), calls)  # fmt: skip
    if kind == "error":
        return ErrorFrame(
            as_code(_str(f.get("code"))),
            _str(f.get("message")) or "error",
            _str(f.get("request_id")),
            sid,
            _num(f.get("retry_after")),
        )
    if kind == "resumed" and sid:
        return Resumed(sid, _int(f.get("after")) or 0)
    if kind == "cancelled" and sid:
        raw = f.get("finish_reason")
        return Cancelled(
            sid, _str(f.get("state")) or "", None if raw is None else finish_reason(raw)
        )
    if kind == "hello":
        return Hello(
            _int(f.get("protocol")) or 0,
            _num(f.get("heartbeat_s")),
            _int(f.get("max_frame_bytes")),
            _str(f.get("server")),
            f.get("worker_ready") is not False,
        )
    if kind == "notice":
        return Notice(
            _str(f.get("code")) or "", _str(f.get("message")) or "", _num(f.get("drain_s"))
        )
    if kind == "pong":
        return Pong()
    return Unknown(f)
