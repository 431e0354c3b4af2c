"""Non-streaming OpenAI bodies, written from the stream log's text, sans I/O.

A non-streaming ``chat.completion``/``text_completion`` answer is the events of its
streams (one per choice, gateway/http/openai_choices.py) folded into one JSON body.
:class:`Collector` folds one stream's events, keeping what the body needs as text, not
as objects: each token event's text and, when logprobs were asked for, each event's
logprobs as already-encoded JSON, one fragment per array (``logprobs.content``; or
``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``), rendered from the
event's stored ``l`` field (core/wire/logprobs.py) and dropped. :func:`answer_body`
splices the fragments into the body's bytes. So one request holds about the bytes of its
JSON answer, never one dict per token entry: a ``n x max_tokens x (1 + top_logprobs)``
answer would take several times its JSON's size as Python objects. The bytes are those
``json.dumps`` writes for the whole object (compact, UTF-8 as is), as a JSON response
writes them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tokenrelay.core.wire.events import Event
from tokenrelay.core.wire.tools import content_before_calls, decode_calls
from tokenrelay.core.wire.vocabulary import EventKind, FinishReason
from tokenrelay.gateway.http.openai_render import StreamFormat, dumps, stream_error, usage

__all__ = ["Collector", "answer_body"]


class Collector:
    """Folds the events of one stream (one choice) of a non-streaming request."""

    def __init__(self, fmt: StreamFormat, stream_id: str) -> None:
        self.fmt = fmt
        self.stream_id = stream_id
        self.parts: list[str] = []
        self.logprobs: dict[str, list[bytes]] = {}  # each array's items, a fragment per event
        self.reason: str | None = None  # set by the done event
        self.usage: dict[str, int] = {}
        self._calls: list[dict[str, Any]] = []

    def add(self, ev: Event) -> bool:
        """Take one event; True once the response is complete (see :meth:`pieces`).

        Raises :class:`ApiError` when the request was rejected or failed.
        """
        if ev.kind == EventKind.REJECTED and ev.code != FinishReason.CANCELLED:
            raise stream_error(ev)
        if ev.kind == EventKind.TOKEN:
            self.parts.append(ev.shown)  # the content: call markup left out
            if self.fmt.logprobs:
                for key, value in (self.fmt.render_logprobs(ev) or {}).items():
                    if isinstance(value, list) and value:  # (chat's "refusal" is null)
                        self.logprobs.setdefault(key, []).append(dumps(value)[1:-1].encode())
        elif ev.kind == EventKind.DONE:
            reason = ev.finish_reason or FinishReason.ERROR
            if reason == FinishReason.ERROR:
                raise stream_error(ev)
            self.reason, self.usage = reason, usage(ev)
            calls = decode_calls(ev.tool_calls) if self.fmt.kind == "chat" else ()
            self._calls = [c.to_openai() for c in calls]
            return True
        return False

    def pieces(self) -> list[bytes]:
        """The finished choice's JSON object (``choices[i]`` of the body), in pieces."""
        fmt, text = self.fmt, "".join(self.parts)
        if fmt.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            if self._calls:
                message["content"] = content_before_calls(text) or None
                message["tool_calls"] = self._calls
            head: dict[str, Any] = {"index": fmt.index, "message": message}
        else:
            head = {"index": fmt.index, "text": text}
        out = [dumps(head)[:-1].encode(), b',"logprobs":']
        if fmt.logprobs:  # every key, even for a completion without a token
            _splice(out, fmt.logprobs_body(0, "", []), self.logprobs)
        else:
            out.append(b"null")
        out.append(b',"finish_reason":' + dumps(self.reason).encode() + b"}")
        return out

    def body(self) -> bytes:
        """The whole response body of this one choice."""
        return answer_body([self])

    @property
    def result(self) -> dict[str, Any] | None:
        """The body decoded (``None`` until the done event): to look inside it."""
        return None if self.reason is None else json.loads(self.body())


def _splice(out: list[bytes], template: dict[str, Any], arrays: dict[str, list[bytes]]) -> None:
    """Add ``template`` as JSON to ``out``, each of its arrays holding ``arrays[key]``'s
    items (the fragments themselves: joined once, with the whole body)."""
    for i, (key, value) in enumerate(template.items()):
        out.append(b"{" if i == 0 else b",")
        if not isinstance(value, list):
            out.append(dumps({key: value})[1:-1].encode())
            continue
        out.append(dumps(key).encode() + b":[")
        for j, fragment in enumerate(arrays.get(key, ())):
            out += (b",", fragment) if j else (fragment,)
        out.append(b"]")
    out.append(b"}")


def answer_body(collectors: Sequence[Collector]) -> bytes:
    """The ``chat.completion``/``text_completion`` body of finished choices, in order (``n``
    > 1: one answer; the prompt counted once, the completion tokens of every choice)."""
    first = collectors[0]
    fmt = first.fmt
    total = sum(c.usage["completion_tokens"] for c in collectors)
    counts = {**first.usage, "completion_tokens": total,
              "total_tokens": first.usage["prompt_tokens"] + total}  # fmt: skip
    head = {
        "id": fmt.response_id(first.stream_id),
        "object": "chat.completion" if fmt.kind == "chat" else "text_completion",
        "created": fmt.created,
        "model": fmt.model,
    }
    out = [dumps(head)[:-1].encode(), b',"choices":[']
    for i, collector in enumerate(collectors):
        out += [b","] if i else []
        out += collector.pieces()
    out.append(b'],"usage":' + dumps(counts).encode() + b"}")
    return b"".join(out)
