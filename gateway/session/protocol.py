"""WebSocket protocol v1, sans I/O: parse client frames, build server frames.

Nothing here touches a socket or Redis. :func:`parse_frame` turns one text
frame into a typed :class:`Generate`, :class:`Cancel`, :class:`Resume` or
:class:`Ping`, or raises :class:`ProtocolError` carrying the error code the
client gets back (and the ``request_id``/``stream_id`` it can correlate it
with). The ``*_frame`` functions build server frames as plain dicts, and
:func:`encode` serialises them. docs/protocol.md is the reference.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from tokenrelay.core.wire.errors import ERROR_CODES, RequestError, lookup
from tokenrelay.core.wire.events import (
    FINISH_REASONS as FINISH_REASONS,  # re-exported: done reasons
)
from tokenrelay.core.wire.keys import MAX_MODEL_NAME, STREAM_ID_RE
from tokenrelay.core.wire.logprobs import chat_content, decode_logprobs
from tokenrelay.core.wire.params import MAX_CHOICES, SamplingParams
from tokenrelay.core.wire.requests import (
    MAX_SEED,
    check_input_size,
    validate_detach_timeout,
    validate_messages,
    validate_params,
    validate_request_id,
    validate_resume_token,
)
from tokenrelay.core.wire.requests import Limits as Limits  # re-exported: parse_frame takes them
from tokenrelay.core.wire.requests import Message as Message
from tokenrelay.core.wire.tools import decode_calls, decode_deltas, delta_to_openai
from tokenrelay.core.wire.vocabulary import ErrorCode

PROTOCOL_VERSION = 1

CLOSE_GOING_AWAY = 1001  # the gateway is shutting down
CLOSE_POLICY = 1008  # the client broke a policy (e.g. kept flooding while rate limited)
CLOSE_TOO_BIG = 1009  # a frame over --max-frame-bytes
CLOSE_OVERLOADED = 1013  # too many connections: try again later


class ProtocolError(Exception):
    """A client-visible error: becomes an ``error`` frame.

    ``retry_after`` is kept only for the codes whose frame carries it
    (``rate_limited``, ``overloaded``: :attr:`core.wire.errors.ErrorCode.retry_in_frame`).
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        request_id: str | None = None,
        stream_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.stream_id = stream_id
        self.retry_after = retry_after if lookup(code).retry_in_frame else None

    def frame(self) -> dict[str, Any]:
        """The ``error`` frame for this error."""
        return error_frame(
            self.code,
            self.message,
            request_id=self.request_id,
            stream_id=self.stream_id,
            retry_after=self.retry_after,
        )


@dataclass(frozen=True)
class Generate:
    """``generate``: start a completion (chat ``messages`` or a raw ``prompt``)."""

    request_id: str | None
    params: SamplingParams
    messages: tuple[Message, ...] | None = None
    prompt: str | None = None
    model: str | None = None  # None: the gateway's default model
    n: int = 1  # choices: streams started, each with its own ``started`` frame
    # W3C trace context of the client (checked where it is used, core/tracing.py: a bad
    # one starts a new trace, never an error)
    traceparent: str | None = None
    # seconds of generating with no client attached (None: --detach-timeout): not in body()
    detach_timeout: float | None = None

    def body(self, index: int = 0) -> dict[str, Any]:
        """The request of choice ``index`` as JSON-able data for the engine worker (with
        a ``seed``, choice ``index`` samples with ``seed + index``)."""
        params = dataclasses.asdict(self.params)
        if index and params["seed"] is not None:
            params["seed"] = (params["seed"] + index) % MAX_SEED
        out: dict[str, Any] = {"params": params}
        if self.messages is not None:
            out["messages"] = [m.body() for m in self.messages]
        else:
            out["prompt"] = self.prompt
        return out


@dataclass(frozen=True)
class Cancel:
    """``cancel``: stop a stream (``resume_token`` needed from another socket)."""

    stream_id: str
    resume_token: str | None = None


@dataclass(frozen=True)
class Resume:
    """``resume``: replay the events with seq > ``after``, then tail live."""

    stream_id: str
    resume_token: str
    after: int = 0


@dataclass(frozen=True)
class Ping:
    """``ping``: answered with ``pong``."""


ClientFrame = Generate | Cancel | Resume | Ping


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_frame(data: str, limits: Limits | None = None) -> ClientFrame:
    """Parse and validate one client text frame; raises :class:`ProtocolError`."""
    limits = limits or Limits()
    try:
        obj = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"frame is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "frame must be a JSON object")
    if _SURROGATE_ESCAPE.search(data):  # "\ud800" alone parses, but is no UTF-8 text
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, "frame holds an unpaired UTF-16 surrogate"
            ) from None
    kind = obj.get("type")
    if kind is None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "missing field 'type'")
    if not isinstance(kind, str):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "field 'type' must be a string")
    if kind == "generate":
        return _parse_generate(obj, limits)
    if kind == "cancel":
        sid = _stream_id(obj)
        token = obj.get("resume_token")
        return Cancel(sid, None if token is None else _resume_token(token, sid))
    if kind == "resume":
        return _parse_resume(obj)
    if kind == "ping":
        return Ping()
    shown = kind if len(kind) <= 40 else kind[:40] + "..."
    raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown frame type {shown!r}")


def _stream_id(obj: dict[str, Any]) -> str:
    sid = obj.get("stream_id")
    if sid is None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "missing field 'stream_id'")
    if not isinstance(sid, str):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "stream_id must be a string")
    if not STREAM_ID_RE.fullmatch(sid):
        shown = sid if len(sid) <= 64 else None
        raise ProtocolError(ErrorCode.NOT_FOUND, "no such stream", stream_id=shown)
    return sid


def _resume_token(token: Any, sid: str) -> str:
    try:
        return validate_resume_token(token)
    except RequestError as exc:
        raise ProtocolError(exc.code, exc.message, stream_id=sid) from None


def _parse_resume(obj: dict[str, Any]) -> Resume:
    sid = _stream_id(obj)
    token = obj.get("resume_token")
    if token is None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "missing field 'resume_token'", stream_id=sid)
    token = _resume_token(token, sid)
    after = obj.get("after", 0)
    if isinstance(after, bool) or not isinstance(after, int):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "after must be an integer", stream_id=sid)
    if after < 0:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "after must be >= 0", stream_id=sid)
    return Resume(sid, token, after)


def _parse_generate(obj: dict[str, Any], limits: Limits) -> Generate:
    try:  # a refused id is not echoed: it may be what made it unsafe
        rid = validate_request_id(obj.get("request_id"), limits)
    except RequestError as exc:
        raise ProtocolError(exc.code, exc.message) from None
    messages, prompt = obj.get("messages"), obj.get("prompt")
    if messages is not None and prompt is not None:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, "give either 'messages' or 'prompt', not both", request_id=rid
        )
    if messages is None and prompt is None:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, "missing field 'messages' (or 'prompt')", request_id=rid
        )
    try:
        parsed: tuple[Message, ...] | None = None
        if messages is not None:
            parsed = validate_messages(messages, limits)
        else:
            if not isinstance(prompt, str):
                raise RequestError(ErrorCode.BAD_REQUEST, "prompt must be a string", "prompt")
            if not prompt:
                raise RequestError(ErrorCode.BAD_REQUEST, "prompt must not be empty", "prompt")
            check_input_size(len(prompt), limits)
        raw = obj.get("params")
        if raw is not None and not isinstance(raw, dict):
            raise RequestError(ErrorCode.BAD_REQUEST, "params must be an object", "params")
        raw = dict(raw or {})
        n = raw.pop("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise RequestError(
                ErrorCode.BAD_REQUEST, f"n must be an integer from 1 to {MAX_CHOICES}", "n"
            )
        detach = validate_detach_timeout(raw.pop("detach_timeout", None), limits)
        params = validate_params(raw, limits)
    except RequestError as exc:
        raise ProtocolError(exc.code, exc.message, request_id=rid) from None
    model = obj.get("model")
    if model is not None and (not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_NAME):
        message = f"model must be a string of 1 to {MAX_MODEL_NAME} characters"
        raise ProtocolError(ErrorCode.BAD_REQUEST, message, request_id=rid)
    tp = obj.get("traceparent")
    traceparent = tp if isinstance(tp, str) else None
    return Generate(rid, params, parsed, prompt if parsed is None else None, model, n, traceparent,
                    detach)  # fmt: skip


# --- server frames ---------------------------------------------------------


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_json_str = json.encoder.encode_basestring  # a JSON string literal, non-ASCII kept as is


def encode(frame: dict[str, Any]) -> str:
    """Serialise a server frame (compact JSON, UTF-8 kept as is)."""
    return _ENCODER.encode(frame)


def hello_frame(
    heartbeat_s: float, *, max_frame_bytes: int, server: str, worker_ready: bool = True,
    detach: tuple[float, float] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The ``hello`` frame; ``detach``: the gateway's ``--detach-timeout`` and
    ``--max-detach-timeout`` (the default and the most of a ``detach_timeout`` param)."""
    out: dict[str, Any] = {
        "type": "hello",
        "protocol": PROTOCOL_VERSION,
        "heartbeat_s": heartbeat_s,
        "max_frame_bytes": max_frame_bytes,
        "server": server,
        "worker_ready": worker_ready,  # else a ``worker_ready`` notice follows when one is
    }
    if detach is not None:
        out["detach_timeout"], out["max_detach_timeout"] = detach
    return out


def started_frame(
    request_id: str | None,
    stream_id: str,
    resume_token: str,
    prompt_tokens: int,
    index: int | None = None,
) -> dict[str, Any]:
    """A ``started`` frame; ``index``: the choice, for a ``generate`` with ``n`` > 1."""
    out: dict[str, Any] = {
        "type": "started",
        "request_id": request_id,
        "stream_id": stream_id,
        "resume_token": resume_token,
        "prompt_tokens": prompt_tokens,
    }
    if index is not None:
        out["index"] = index
    return out


def token_frame(
    stream_id: str, seq: int, text: str, logprobs: str | None = None, calls: str | None = None
) -> dict[str, Any]:
    """A ``token`` frame; ``logprobs``, ``calls``: the event's stored ``l`` and ``d``
    fields (``calls`` go as ``tool_calls``, OpenAI's ``delta.tool_calls`` shape)."""
    out: dict[str, Any] = {"type": "token", "stream_id": stream_id, "seq": seq, "text": text}
    if logprobs is not None:
        out["logprobs"] = chat_content(decode_logprobs(logprobs)[1])
    if deltas := decode_deltas(calls):
        out["tool_calls"] = [delta_to_openai(d, stream_id) for d in deltas]
    return out


def encode_token(stream_id: str, seq: int, text: str, logprobs: str | None = None) -> str:
    """``encode(token_frame(...))``, built directly: the one frame sent per token.

    ``logprobs`` (a token event's stored ``l`` field) adds the optional
    ``logprobs`` list: one ``{token, logprob, bytes, top_logprobs}`` per token of
    ``text``, OpenAI's chat shape.
    """
    if logprobs is not None:
        return encode(token_frame(stream_id, seq, text, logprobs))
    return (
        f'{{"type":"token","stream_id":{_json_str(stream_id)},'
        f'"seq":{int(seq)},"text":{_json_str(text)}}}'
    )


def done_frame(
    stream_id: str,
    seq: int,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    message: str | None = None,
    tool_calls: str | None = None,
) -> dict[str, Any]:
    """A ``done`` frame; ``tool_calls``: the done event's stored calls (OpenAI's shape)."""
    out: dict[str, Any] = {
        "type": "done",
        "stream_id": stream_id,
        "seq": seq,
        "finish_reason": finish_reason,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
    }
    if message:
        out["message"] = message
    calls = decode_calls(tool_calls)
    if calls:
        out["tool_calls"] = [c.to_openai() for c in calls]
    return out


def resumed_frame(stream_id: str, after: int) -> dict[str, Any]:
    return {"type": "resumed", "stream_id": stream_id, "after": after}


def cancelled_frame(stream_id: str, state: str, finish_reason: str | None) -> dict[str, Any]:
    """Answer to ``cancel``: ``state`` is ``cancelling`` or ``finished``."""
    return {
        "type": "cancelled",
        "stream_id": stream_id,
        "state": state,
        "finish_reason": finish_reason,
    }


def error_frame(
    code: ErrorCode,
    message: str,
    *,
    request_id: str | None = None,
    stream_id: str | None = None,
    retry_after: float | None = None,
) -> dict[str, Any]:
    """An ``error`` frame; ``retry_after`` (seconds) for rate_limited / overloaded."""
    out: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if request_id is not None:
        out["request_id"] = request_id
    if stream_id is not None:
        out["stream_id"] = stream_id
    if retry_after is not None:
        out["retry_after"] = max(1, math.ceil(retry_after))
    return out


def pong_frame() -> dict[str, Any]:
    return {"type": "pong"}
