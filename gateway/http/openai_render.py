"""Stream-log events as OpenAI responses, sans I/O.

One stream log feeds both transports; this module renders its events the
OpenAI way. :class:`ChunkEncoder` turns each :class:`core.wire.events.Event`
into SSE bytes (``chat.completion.chunk`` or ``text_completion`` chunks, each
with ``id: <seq>``; then the usage chunk when asked for, then
``data: [DONE]``), and :class:`Collector` folds the events of a non-streaming
request into one ``chat.completion``/``text_completion`` body. The
:class:`StreamFormat` (chat or completion, model, ``created``, usage chunk or
not) is stored with the stream so a resumed stream renders the same chunks.

Event to chunk (chat): seq 0 ``accepted`` -> the role chunk
(``delta: {"role": "assistant", "content": ""}``); each ``token`` -> a content
chunk; ``done`` -> the chunk with ``finish_reason`` (``stop``, ``length``, or
this server's ``cancelled``/``expired``), or for ``error`` an
``{"error": {...}}`` event, which the OpenAI SDKs raise as ``APIError``.

When the request asked for logprobs, each content chunk (and the body) carries
the logprobs of its tokens in OpenAI's shape: chat ``logprobs.content[]``,
completions ``logprobs.tokens/token_logprobs/top_logprobs/text_offset``
(core/wire/logprobs.py), read from the token events' stored ``l`` field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from core.wire.events import Event
from core.wire.logprobs import Logprobs, chat_content, completion_logprobs, decode_logprobs
from gateway.http.openai_request import ApiError, error_body, error_for_code
from gateway.http.sse import DONE, encode_event

__all__ = [
    "ChunkEncoder",
    "Collector",
    "StreamFormat",
    "dumps",
    "error_body",
    "model_card",
    "models_body",
    "stream_error",
    "usage",
]


def dumps(obj: Any) -> str:
    """Compact JSON, UTF-8 kept as is."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class StreamFormat:
    """How a stream renders as OpenAI chunks (kept in the stream's metadata)."""

    kind: str  # "chat" or "completion"
    model: str
    created: int
    include_usage: bool = False
    logprobs: bool = False  # chunks and bodies carry the tokens' logprobs

    def response_id(self, stream_id: str) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + stream_id

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def encode(self) -> str:
        out = {"k": self.kind, "m": self.model, "c": self.created, "u": self.include_usage}
        if self.logprobs:
            out["l"] = True
        return dumps(out)

    def render_logprobs(self, ev: Event) -> dict[str, Any] | None:
        """The ``logprobs`` of a token event's chunk (``None`` when not asked for; a stream
        started over the WebSocket with ``params.logprobs`` has them on its events)."""
        if not self.logprobs and ev.logprobs is None:
            return None
        offset, entries = decode_logprobs(ev.logprobs)
        return self.logprobs_body(offset, ev.text, entries)

    def logprobs_body(self, offset: int, text: str, entries: list[Logprobs]) -> dict[str, Any]:
        """OpenAI's ``logprobs`` object of ``entries``, whose text ``text`` starts at ``offset``."""
        if self.kind == "chat":
            return {"content": chat_content(entries), "refusal": None}
        return completion_logprobs(offset, text, entries)

    @classmethod
    def decode(cls, raw: str | bytes | None, *, model: str, created: int) -> StreamFormat:
        """The stored format; a stream started elsewhere (WebSocket) renders as chat."""
        try:
            obj = json.loads(raw) if raw else {}
        except ValueError:
            obj = {}
        if not isinstance(obj, dict):
            obj = {}
        k, m, c = obj.get("k"), obj.get("m"), obj.get("c")
        kind = k if k in ("chat", "completion") else "chat"
        name = m if isinstance(m, str) else model
        when = c if isinstance(c, int) and not isinstance(c, bool) else created
        return cls(str(kind), name, when, obj.get("u") is True, obj.get("l") is True)


def usage(ev: Event) -> dict[str, int]:
    return {
        "prompt_tokens": ev.prompt_tokens,
        "completion_tokens": ev.completion_tokens,
        "total_tokens": ev.prompt_tokens + ev.completion_tokens,
    }


def stream_error(ev: Event) -> ApiError:
    """The error a ``rejected`` event or a ``done``/``error`` event stands for."""
    if ev.kind == "rejected":
        return error_for_code(ev.code or "internal", ev.message or "the request was rejected")
    message = ev.message or "the engine failed to complete the request"
    lowered = message.lower()
    if "stopped responding" in lowered or "no engine worker" in lowered or "shut down" in lowered:
        return error_for_code("unavailable", message)
    return error_for_code("internal", message)


class ChunkEncoder:
    """Renders one stream's events as SSE bytes, in seq order."""

    def __init__(self, fmt: StreamFormat, stream_id: str) -> None:
        self.fmt = fmt
        self.stream_id = stream_id
        self.id = fmt.response_id(stream_id)
        self.finished = False
        self._failed = False

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": self.fmt.object,
            "created": self.fmt.created,
            "model": self.fmt.model,
            "choices": choices,
        }
        if self.fmt.include_usage:
            out["usage"] = None
        return out

    def _choice(
        self,
        text: str | None,
        finish_reason: str | None,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> Any:
        if self.fmt.kind == "completion":
            return {
                "index": 0,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        delta: dict[str, Any] = {}
        if role:
            delta = {"role": "assistant", "content": ""}
        elif text is not None:
            delta = {"content": text}
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def _event(self, seq: int, obj: dict[str, Any]) -> bytes:
        return encode_event(dumps(obj), id=seq)

    def encode(self, ev: Event) -> bytes:
        """The SSE bytes for ``ev`` (empty when it shows as nothing)."""
        if self.finished:
            return b""
        if ev.kind == "accepted" or (ev.kind == "rejected" and ev.code == "cancelled"):
            if self.fmt.kind == "chat":
                return self._event(ev.seq, self._chunk([self._choice(None, None, role=True)]))
            return b""
        if ev.kind == "rejected":
            self._failed = True
            return self._event(ev.seq, stream_error(ev).body())
        if ev.kind == "token":
            lp = self.fmt.render_logprobs(ev)
            return self._event(ev.seq, self._chunk([self._choice(ev.text, None, logprobs=lp)]))
        if ev.kind == "done":
            return self.done(ev)
        return b""

    def done(self, ev: Event) -> bytes:
        """The end: finish chunk (or error event), usage chunk if asked for, ``[DONE]``."""
        self.finished = True
        out = b""
        reason = ev.finish_reason or "error"
        if reason == "error":
            if not self._failed:
                out += self._event(ev.seq, stream_error(ev).body())
        else:
            out += self._event(ev.seq, self._chunk([self._choice(None, reason)]))
        if self.fmt.include_usage:
            last = self._chunk([])
            last["usage"] = usage(ev)
            out += self._event(ev.seq, last)
        return out + DONE

    def error(self, exc: ApiError, *, final: bool = True) -> bytes:
        """An ``{"error": ...}`` event (no id); then ``[DONE]`` when ``final``.

        Without ``final`` the stream is left open-ended: the client should
        resume from its last event id later.
        """
        self.finished = True
        return encode_event(dumps(exc.body())) + (DONE if final else b"")

    def trailer(self, ev: Event) -> bytes:
        """What follows the final event: usage chunk (if asked for) and ``[DONE]``."""
        self.finished = True
        if not self.fmt.include_usage:
            return DONE
        last = self._chunk([])
        last["usage"] = usage(ev)
        return self._event(ev.seq, last) + DONE


class Collector:
    """Folds the events of a non-streaming request into one response body."""

    def __init__(self, fmt: StreamFormat, stream_id: str) -> None:
        self.fmt = fmt
        self.stream_id = stream_id
        self.parts: list[str] = []
        self.logprobs: dict[str, list[Any]] = {}  # each key's list, over the token events
        self.result: dict[str, Any] | None = None

    def add(self, ev: Event) -> bool:
        """Take one event; True once the response is complete (see :attr:`result`).

        Raises :class:`ApiError` when the request was rejected or failed.
        """
        if ev.kind == "rejected" and ev.code != "cancelled":
            raise stream_error(ev)
        if ev.kind == "token":
            self.parts.append(ev.text)
            for key, value in (self.fmt.render_logprobs(ev) or {}).items():
                if isinstance(value, list):  # (chat's "refusal" is null)
                    self.logprobs.setdefault(key, []).extend(value)
        elif ev.kind == "done":
            reason = ev.finish_reason or "error"
            if reason == "error":
                raise stream_error(ev)
            self.result = self.body(reason, ev)
            return True
        return False

    def body(self, reason: str, ev: Event) -> dict[str, Any]:
        text = "".join(self.parts)
        fmt = self.fmt
        logprobs = None
        if fmt.logprobs:  # every key, even for a completion without a token
            logprobs = {**fmt.logprobs_body(0, "", []), **self.logprobs}
        if fmt.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": logprobs,
                "finish_reason": reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
            obj = "text_completion"
        return {
            "id": self.fmt.response_id(self.stream_id),
            "object": obj,
            "created": self.fmt.created,
            "model": self.fmt.model,
            "choices": [choice],
            "usage": usage(ev),
        }


def models_body(model: str, created: int) -> dict[str, Any]:
    """``GET /v1/models``: the one served model."""
    return {"object": "list", "data": [model_card(model, created)]}


def model_card(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "tokenrelay"}
