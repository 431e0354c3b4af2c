"""Non-streaming bodies written from the stream log's text (gateway/http/openai_body.py).

The body is byte for byte what ``JSONResponse`` wrote of the whole answer built as
Python objects (rebuilt here, the way the gateway did before), while the collector
keeps only text: a large logprobs answer costs about its JSON's size, not a dict per
token entry.
"""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pytest
from starlette.responses import JSONResponse

from tokenrelay.core.wire.events import Event
from tokenrelay.core.wire.logprobs import (
    Logprobs,
    TokenLogprob,
    chat_content,
    completion_logprobs,
    decode_logprobs,
    encode_logprobs,
)
from tokenrelay.core.wire.tools import ToolCall, content_before_calls, decode_calls, encode_calls
from tokenrelay.gateway.http.openai_body import Collector, answer_body
from tokenrelay.gateway.http.openai_render import StreamFormat, usage

SID = "abcdefghijklmnop1234"


def entry(i: int, top: int) -> Logprobs:
    """Token ``i`` with ``top`` alternatives (one not valid UTF-8, one not ASCII)."""
    chosen = TokenLogprob(f" t{i}é", -0.25 - i / 1000, f" t{i}é".encode())
    alts = [TokenLogprob(f"a{k}\ufffd", -1.5 - k / 7, b"a\xff") for k in range(top)]
    return Logprobs(chosen, tuple(alts))


def log_of(tokens: int, top: int, per_event: int = 1, calls: str | None = None) -> list[Event]:
    """A stream's events: ``tokens`` tokens with logprobs, ``per_event`` to a token event."""
    evs = [Event(0, "accepted", prompt_tokens=7)]
    at, seq = 0, 1
    for first in range(0, tokens, per_event):
        entries = [entry(i, top) for i in range(first, min(tokens, first + per_event))]
        text = "".join(e.chosen.token for e in entries)
        evs.append(Event(seq, "token", text=text, logprobs=encode_logprobs(at, entries)))
        at, seq = at + len(text), seq + 1
    done = Event(seq, "done", finish_reason="tool_calls" if calls else "length",
                 prompt_tokens=7, completion_tokens=tokens, tool_calls=calls)  # fmt: skip
    return [*evs, done]


def before(fmt: StreamFormat, evs: list[Event]) -> dict[str, Any]:
    """The body as the gateway built it before: every token entry a dict."""
    text = "".join(ev.text for ev in evs if ev.kind == "token")
    arrays: dict[str, list[Any]] = {}
    for ev in evs:
        if ev.kind == "token":
            offset, entries = decode_logprobs(ev.logprobs)
            lp: dict[str, Any] = (
                {"content": chat_content(entries)}
                if fmt.kind == "chat"
                else completion_logprobs(offset, ev.text, entries)
            )
            for key, value in lp.items():
                arrays.setdefault(key, []).extend(value)
    logprobs = None
    if fmt.logprobs:
        empty = (
            {"content": [], "refusal": None}
            if fmt.kind == "chat"
            else completion_logprobs(0, "", [])
        )
        logprobs = {**empty, **arrays}
    done = evs[-1]
    if fmt.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        calls = decode_calls(done.tool_calls)
        if calls:
            message["content"] = content_before_calls(text) or None
            message["tool_calls"] = [c.to_openai() for c in calls]
        choice: dict[str, Any] = {"index": fmt.index, "message": message}
    else:
        choice = {"index": fmt.index, "text": text}
    choice |= {"logprobs": logprobs, "finish_reason": done.finish_reason}
    return {"id": fmt.response_id(SID), "object": "chat.completion" if fmt.kind == "chat"
            else "text_completion", "created": fmt.created, "model": fmt.model,
            "choices": [choice], "usage": usage(done)}  # fmt: skip


def collect(fmt: StreamFormat, evs: list[Event]) -> Collector:
    col = Collector(fmt, SID)
    assert [col.add(ev) for ev in evs][-1] is True
    return col


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("logprobs", [True, False])
@pytest.mark.parametrize(("tokens", "per_event"), [(0, 1), (1, 1), (9, 3), (10, 4)])
def test_the_body_is_the_bytes_of_the_whole_object(
    kind: str, logprobs: bool, tokens: int, per_event: int
) -> None:
    fmt = StreamFormat(kind, "m", 5, logprobs=logprobs, index=0)
    evs = log_of(tokens, 3, per_event)
    assert collect(fmt, evs).body() == JSONResponse(before(fmt, evs)).body


def test_tool_calls_and_several_choices_are_the_same_bytes() -> None:
    call = encode_calls([ToolCall("call_1", "get_time", '{"tz": "UTC"}')])
    fmt = StreamFormat("chat", "m", 5, logprobs=True, tools=True)
    evs = log_of(4, 2, calls=call)
    assert collect(fmt, evs).body() == JSONResponse(before(fmt, evs)).body
    fmts = [StreamFormat("completion", "m", 5, logprobs=True, index=i) for i in range(3)]
    logs = [log_of(3 + i, 2) for i in range(3)]
    bodies = [before(f, evs) for f, evs in zip(fmts, logs, strict=True)]
    want = bodies[0] | {"choices": [b["choices"][0] for b in bodies]}
    want["usage"] = {"prompt_tokens": 7, "completion_tokens": 12, "total_tokens": 19}
    got = answer_body([collect(f, evs) for f, evs in zip(fmts, logs, strict=True)])
    assert got == JSONResponse(want).body


def test_a_large_answer_costs_about_its_json_not_a_dict_per_entry() -> None:
    """2000 tokens x 21 entries: the collector keeps bytes only, and folding the events and
    writing the body peaks under three times the body's size (the fragments and the body);
    built as dicts (:func:`before`) the same answer peaks over ten times it."""
    fmt = StreamFormat("chat", "m", 5, logprobs=True)
    evs = log_of(2000, 20)
    tracemalloc.start()
    try:
        col = collect(fmt, evs)
        assert all(type(f) is bytes for frags in col.logprobs.values() for f in frags)
        assert all(type(p) is str for p in col.parts)
        body = col.body()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(body) > 2_000_000
    assert peak < 3 * len(body), (peak, len(body))
    assert json.loads(body)["choices"][0]["logprobs"]["content"][1999]["token"] == " t1999é"
