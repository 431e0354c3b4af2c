"""gateway/http/openai_render.py with tools offered: the worker's log (worker/outbox.py
reading the calls as they stream) renders as content, then delta.tool_calls fragments as
they were generated, message.tool_calls in a body, and a resume renders the same."""

from __future__ import annotations

import json
from typing import Any

from tokenrelay.core.wire.events import Event, event_from_fields
from tokenrelay.core.wire.tool_stream import CallStream
from tokenrelay.core.wire.tools import parse_tools, render_call
from tokenrelay.core.wire.vocabulary import FinishReason, ToolFormat
from tokenrelay.gateway.http.openai_body import Collector
from tokenrelay.gateway.http.openai_render import ChunkEncoder, StreamFormat
from tokenrelay.gateway.http.sse import SSEParser

SID = "abcdefghijklmnop1234"
TOOLS = parse_tools([{"type": "function", "function": {"name": "get_time"}}])
FMT = StreamFormat("chat", "default", 1700000000, tools=True)


def log_of(pieces: list[str]) -> list[Event]:
    """The stream log an engine worker writes for these text pieces, as it writes it."""
    from tokenrelay.worker.outbox import Active

    a = Active(SID, None, "1-0", 30.0, 600.0, tools=TOOLS)
    a.calls = CallStream(ToolFormat.HERMES, TOOLS, SID)
    stored = [a.token_event(t, with_ids=True) for t in pieces]
    stored += a.finish_events(FinishReason.STOP, 5, len(pieces), None)
    out = [Event(0, "accepted", prompt_tokens=5)]
    for seq, flat in enumerate(stored, start=1):
        out.append(event_from_fields(seq, dict(zip(flat[::2], flat[1::2], strict=True))))
    return out


def sse(evs: list[Event], after: int = -1) -> list[tuple[str | None, Any]]:
    enc = ChunkEncoder(FMT, SID)
    parser = SSEParser()
    out = []
    for ev in evs[after + 1 :]:
        for msg in parser.feed(enc.encode(ev)):
            out.append((msg.id, msg.data if msg.data == "[DONE]" else json.loads(msg.data)))
    return out


def deltas(chunks: list[tuple[str | None, Any]]) -> list[dict[str, Any]]:
    return [c["choices"][0]["delta"] for _, c in chunks if c != "[DONE]" and c["choices"]]


CALL = render_call("get_time", {"zone": "UTC"})
AT = CALL.index('"UTC"')
PIECES = ["Let me ", "check. <", "tool", "_call>", CALL[len("<tool_call>") : AT], CALL[AT:]]


def test_content_stops_at_the_call_and_the_call_streams_in_fragments() -> None:
    got = sse(log_of(PIECES))
    d = deltas(got)
    content = "".join(x.get("content") or "" for x in d)
    assert content == "Let me check. "
    calls = [c for x in d for c in x.get("tool_calls", [])]
    assert len(calls) == 2 and {c["index"] for c in calls} == {0}  # name, then the rest
    assert calls[0]["function"]["name"] == "get_time" and "name" not in calls[1]["function"]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"zone": "UTC"}'
    finish = [c["choices"][0]["finish_reason"] for _, c in got if c != "[DONE]" and c["choices"]]
    assert finish[-1] == "tool_calls" and got[-1][1] == "[DONE]"


def test_a_resume_from_any_offset_shows_the_rest_exactly_once() -> None:
    evs = log_of(PIECES)
    whole = sse(evs)
    for cut in range(len(evs) - 1):
        first = [(i, c) for i, c in whole if i is not None and int(i) <= cut]
        last_id = max((int(i) for i, _ in first), default=-1)
        rest = sse(evs, after=last_id)
        assert deltas(first) + deltas(rest) == deltas(whole), cut


def test_text_that_made_no_call_is_content_at_the_end() -> None:
    pieces = ["I would use <tool_call> tags", " but not now."]
    d = deltas(sse(log_of(pieces)))
    assert "".join(x.get("content") or "" for x in d) == "".join(pieces)
    assert not any("tool_calls" in x for x in d)


def test_the_body_has_message_tool_calls() -> None:
    col = Collector(FMT, SID)
    for ev in log_of(PIECES):
        col.add(ev)
    assert col.result is not None
    choice = col.result["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check. "
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    col = Collector(FMT, SID)
    for ev in log_of([CALL]):
        col.add(ev)
    assert col.result is not None and col.result["choices"][0]["message"]["content"] is None


def test_the_format_keeps_the_tools_flag() -> None:
    assert StreamFormat.decode(FMT.encode(), model="x", created=1) == FMT
