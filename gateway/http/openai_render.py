"""Stream-log events as OpenAI responses, sans I/O.

One stream log feeds both transports; this module renders its events the
OpenAI way. :class:`ChunkEncoder` turns each :class:`core.wire.events.Event`
into SSE bytes (``chat.completion.chunk`` or ``text_completion`` chunks, each
with ``id: <seq>``; then the usage chunk when asked for, then
``data: [DONE]``); gateway/http/openai_body.py folds the events of a non-streaming
request into one ``chat.completion``/``text_completion`` body. The
:class:`StreamFormat` (chat or completion, model, ``created``, usage chunk or
not) is stored with the stream so a resumed stream renders the same chunks.

Event to chunk (chat): seq 0 ``accepted`` -> the role chunk
(``delta: {"role": "assistant", "content": ""}``); each ``token`` -> a content
chunk; ``done`` -> the chunk with ``finish_reason`` (``stop``, ``length``,
``tool_calls``, or this server's ``cancelled``/``expired``), or for ``error`` an
``{"error": {...}}`` event, which the OpenAI SDKs raise as ``APIError``.

When the request offered tools, each token event's content (:attr:`Event.shown`: the
worker reads the calls out of the text as it streams, core/wire/tool_stream.py) goes out
as ``delta.content`` and its call deltas as ``delta.tool_calls`` entries (the first of a
call with its id, type and name, then ``arguments`` fragments), in the same chunk; an
event that shows nothing sends no chunk. A log whose done event lists calls that no
token event streamed gets them at the end, one chunk each.

When the request asked for logprobs, each content chunk (and the body) carries
the logprobs of its tokens in OpenAI's shape: chat ``logprobs.content[]``,
completions ``logprobs.tokens/token_logprobs/top_logprobs/text_offset``
(core/wire/logprobs.py), read from the token events' stored ``l`` field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenrelay.core.wire.errors import as_code
from tokenrelay.core.wire.events import Event
from tokenrelay.core.wire.logprobs import (
    Logprobs,
    chat_content,
    completion_logprobs,
    decode_logprobs,
)
from tokenrelay.core.wire.tools import decode_deltas, delta_to_openai
from tokenrelay.core.wire.vocabulary import ErrorCode, EventKind, FinishReason
from tokenrelay.gateway.http.openai_request import ApiError, error_body, error_for_code
from tokenrelay.gateway.http.sse import DONE, encode_event

__all__ = [
    "ChunkEncoder",
    "StreamFormat",
    "dumps",
    "error_body",
    "model_card",
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
    tools: bool = False  # tools were offered: text from a <tool_call> on may be calls
    index: int = 0  # the choice this stream is (n > 1, gateway/http/openai_choices.py)

    def response_id(self, stream_id: str) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + stream_id

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def encode(self) -> str:
        out = {"k": self.kind, "m": self.model, "c": self.created, "u": self.include_usage}
        if self.logprobs:
            out["l"] = True
        if self.tools:
            out["t"] = True
        if self.index:
            out["i"] = self.index
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
        flags = obj.get("u") is True, obj.get("l") is True, obj.get("t") is True
        i = obj.get("i")
        index = i if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 128 else 0
        return cls(str(kind), name, when, *flags, index=index)


def usage(ev: Event) -> dict[str, int]:
    return {
        "prompt_tokens": ev.prompt_tokens,
        "completion_tokens": ev.completion_tokens,
        "total_tokens": ev.prompt_tokens + ev.completion_tokens,
    }


def stream_error(ev: Event) -> ApiError:
    """The error a ``rejected`` event or a ``done``/``error`` event stands for."""
    if ev.kind == EventKind.REJECTED:
        return error_for_code(as_code(ev.code), ev.message or "the request was rejected")
    message = ev.message or "the engine failed to complete the request"
    lowered = message.lower()
    if "stopped responding" in lowered or "no engine worker" in lowered or "shut down" in lowered:
        return error_for_code(ErrorCode.UNAVAILABLE, message)
    return error_for_code(ErrorCode.INTERNAL, message)


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
                "index": self.fmt.index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        delta: dict[str, Any] = {}
        if role:
            delta = {"role": "assistant", "content": ""}
        elif text is not None:
            delta = {"content": text}
        choice = {"index": self.fmt.index, "delta": delta, "logprobs": logprobs}
        return {**choice, "finish_reason": finish_reason}

    def _event(self, seq: int, obj: dict[str, Any]) -> bytes:
        return encode_event(dumps(obj), id=seq)

    def encode(self, ev: Event) -> bytes:
        """The SSE bytes for ``ev`` (empty when it shows as nothing)."""
        if self.finished:
            return b""
        if ev.kind == EventKind.ACCEPTED or (
            ev.kind == EventKind.REJECTED and ev.code == FinishReason.CANCELLED
        ):
            if self.fmt.kind == "chat":
                return self._event(ev.seq, self._chunk([self._choice(None, None, role=True)]))
            return b""
        if ev.kind == EventKind.REJECTED:
            self._failed = True
            return self._event(ev.seq, stream_error(ev).body())
        if ev.kind == EventKind.TOKEN:
            return self._token(ev)
        if ev.kind == EventKind.DONE:
            return self.done(ev)
        return b""

    def _token(self, ev: Event) -> bytes:
        lp = self.fmt.render_logprobs(ev)
        text = ev.shown
        deltas = decode_deltas(ev.call_deltas) if self.fmt.kind == "chat" else ()
        if not deltas:
            if not text and self.fmt.tools:
                return b""  # call markup: nothing to show (its logprobs are left out)
            return self._event(ev.seq, self._chunk([self._choice(text, None, logprobs=lp)]))
        delta: dict[str, Any] = {"content": text} if text else {}
        delta["tool_calls"] = [delta_to_openai(d, self.stream_id) for d in deltas]
        choice = {"index": self.fmt.index, "delta": delta, "logprobs": lp, "finish_reason": None}
        return self._event(ev.seq, self._chunk([choice]))

    def done(self, ev: Event) -> bytes:
        """The end: finish chunk (or error event), usage chunk if asked for, ``[DONE]``."""
        self.finished = True
        out = b""
        reason = ev.finish_reason or FinishReason.ERROR
        if reason == FinishReason.ERROR:
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


def model_card(model: str, created: int) -> dict[str, Any]:
    """One model of ``GET /v1/models``."""
    return {"id": model, "object": "model", "created": created, "owned_by": "tokenrelay"}
