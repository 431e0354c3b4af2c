"""gateway/http/openai_render.py with tools offered: content stops at the first call,
calls come as delta.tool_calls / message.tool_calls, a resume renders the same."""

from __future__ import annotations

import json
from typing import Any

from tokenrelay.core.wire.events import Event
from tokenrelay.core.wire.tools import encode_calls, parse_tool_calls, parse_tools, render_call
from tokenrelay.gateway.http.openai_body import Collector
from tokenrelay.gateway.http.openai_render import ChunkEncoder, StreamFormat
from tokenrelay.gateway.http.sse import SSEParser

SID = "abcdefghijklmnop1234"
TOOLS = parse_tools([{"type": "function", "function": {"name": "get_time"}}])
FMT = StreamFormat("chat", "default", 1700000000, tools=True)


def log_of(pieces: list[str]) -> list[Event]:
    """The stream log a worker writes for these text pieces (calls parsed at done)."""
    _, calls = parse_tool_calls("".join(pieces), TOOLS, SID)
    out = [Event(0, "accepted", prompt_tokens=5)]
    out += [Event(i + 1, "token", text=t) for i, t in enumerate(pieces)]
    reason = "tool_calls" if calls else "stop"
    stored = encode_calls(calls) if calls else None
    out.append(Event(len(pieces) + 1, "done", finish_reason=reason, prompt_tokens=5,
                     completion_tokens=len(pieces), tool_calls=stored))  # fmt: skip
    return out


def sse(evs: list[Event], after: int = -1) -> list[tuple[str | None, Any]]:
    enc = ChunkEncoder(FMT, SID, quiet_through=after)
    parser = SSEParser()
    out = []
    for ev in evs:
        for msg in parser.feed(enc.encode(ev)):
            out.append((msg.id, msg.data if msg.data == "[DONE]" else json.loads(msg.data)))
    return out


def deltas(chunks: list[tuple[str | None, Any]]) -> list[dict[str, Any]]:
    return [c["choices"][0]["delta"] for _, c in chunks if c != "[DONE]" and c["choices"]]


CALL = render_call("get_time", {"zone": "UTC"})
PIECES = ["Let me ", "check. <", "tool", "_call>", CALL[len("<tool_call>") : 20], CALL[20:]]


def test_content_stops_at_the_call_and_the_call_comes_whole() -> None:
    got = sse(log_of(PIECES))
    d = deltas(got)
    content = "".join(x.get("content") or "" for x in d)
    assert content == "Let me check. "
    calls = [x["tool_calls"] for x in d if "tool_calls" in x]
    assert len(calls) == 1 and calls[0][0]["index"] == 0
    assert calls[0][0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    assert calls[0][0]["id"].startswith("call_") and calls[0][0]["type"] == "function"
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
