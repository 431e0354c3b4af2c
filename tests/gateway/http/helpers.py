"""SSE helpers for the HTTP API tests (httpx + gateway/http/sse.py's parser)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenrelay.gateway.http.sse import SSEEvent, SSEParser

LONG = {"max_tokens": 4000, "temperature": 0, "ignore_eos": True}


def chat_body(prompt: str, **fields: Any) -> dict[str, Any]:
    return {"model": "default", "messages": [{"role": "user", "content": prompt}], **fields}


def _events(resp: httpx.Response) -> Iterator[SSEEvent]:
    parser = SSEParser()
    for chunk in resp.iter_bytes():
        yield from parser.feed(chunk)


def sse_events(resp: httpx.Response) -> Iterator[SSEEvent]:
    """The events of a streaming response, as they arrive (can be read in parts)."""
    it: Iterator[SSEEvent] | None = getattr(resp, "_sse_events", None)
    if it is None:
        it = _events(resp)
        resp._sse_events = it  # type: ignore[attr-defined]
    return it


@dataclass
class Read:
    """What a client saw of an event stream."""

    ids: list[int] = field(default_factory=list)  # id of every chunk (not of [DONE])
    chunks: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False  # saw data: [DONE]

    @property
    def text(self) -> str:
        out = []
        for c in self.chunks:
            for choice in c.get("choices", []):
                out.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
        return "".join(out)

    @property
    def finish_reason(self) -> str | None:
        for c in reversed(self.chunks):
            for choice in c.get("choices", []):
                if choice.get("finish_reason"):
                    return str(choice["finish_reason"])
        return None

    @property
    def last_id(self) -> int:
        return self.ids[-1]


def read_sse(resp: httpx.Response, limit: int | None = None) -> Read:
    """Read chunks until ``[DONE]`` or until ``limit`` chunks (then stop reading)."""
    out = Read()
    for ev in sse_events(resp):
        if ev.data == "[DONE]":
            out.done = True
            break
        out.chunks.append(json.loads(ev.data))
        out.ids.append(int(ev.id) if ev.id is not None else -99)
        if limit is not None and len(out.chunks) >= limit:
            break
    return out


def unique_seqs(ids: list[int]) -> list[int]:
    """Chunk ids with the repeats of the final seq (finish + usage chunks) folded."""
    out: list[int] = []
    for i in ids:
        if not out or out[-1] != i:
            out.append(i)
    return out
