"""gateway/http/openai_render.py: stream-log events as OpenAI chunks and bodies (no server)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenrelay.core.wire.events import Event
from tokenrelay.gateway.http.openai_body import Collector
from tokenrelay.gateway.http.openai_render import ChunkEncoder, StreamFormat
from tokenrelay.gateway.http.openai_request import ApiError
from tokenrelay.gateway.http.sse import SSEParser

SID = "abcdefghijklmnop1234"


def events(*texts: str, reason: str = "stop") -> list[Event]:
    out = [Event(0, "accepted", prompt_tokens=5)]
    out += [Event(i + 1, "token", text=t) for i, t in enumerate(texts)]
    out.append(Event(len(texts) + 1, "done", finish_reason=reason, prompt_tokens=5,
                     completion_tokens=len(texts)))  # fmt: skip
    return out


def render(fmt: StreamFormat, evs: list[Event]) -> list[tuple[str | None, Any]]:
    enc = ChunkEncoder(fmt, SID)
    parser = SSEParser()
    out = []
    for ev in evs:
        for sse in parser.feed(enc.encode(ev)):
            out.append((sse.id, sse.data if sse.data == "[DONE]" else json.loads(sse.data)))
    assert enc.finished
    return out


def test_chat_chunks_with_usage() -> None:
    fmt = StreamFormat("chat", "default", 1700000000, include_usage=True)
    got = render(fmt, events("Hel", "lo"))
    ids = [i for i, _ in got]
    assert ids == ["0", "1", "2", "3", "3", "3"]  # [DONE] carries no id of its own
    chunks = [c for _, c in got[:-1]]
    assert got[-1][1] == "[DONE]"
    for c in chunks:
        assert c["id"] == "chatcmpl-" + SID and c["object"] == "chat.completion.chunk"
        assert c["created"] == 1700000000 and c["model"] == "default"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:3]] == ["Hel", "lo"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[3]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert chunks[4]["choices"] == []
    assert chunks[4]["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


def test_completion_chunks_without_usage() -> None:
    fmt = StreamFormat("completion", "m", 1, include_usage=False)
    got = render(fmt, events("a", "b", reason="length"))
    assert [i for i, _ in got] == ["1", "2", "3", "3"]  # no role chunk for text completions
    chunks = [c for _, c in got[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "b", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_resumed_mid_stream_has_no_role_chunk() -> None:
    fmt = StreamFormat("chat", "default", 1)
    got = render(fmt, events("x", "y")[2:])
    assert [i for i, _ in got] == ["2", "3", "3"]


def test_rejected_and_error_events() -> None:
    fmt = StreamFormat("chat", "default", 1)
    rejected = [
        Event(0, "rejected", code="bad_request", message="prompt: too long"),
        Event(1, "done", finish_reason="error", message="prompt: too long"),
    ]
    got = render(fmt, rejected)
    assert got[0][1]["error"]["code"] == "bad_request" and got[0][0] == "0"
    assert got[-1][1] == "[DONE]" and len(got) == 2
    died = [*events("a")[:2], Event(2, "done", finish_reason="error",
                                    message="engine worker w1 stopped responding")]  # fmt: skip
    got = render(fmt, died)
    assert got[2][1]["error"]["code"] == "unavailable" and got[2][0] == "2"
    assert got[-1][1] == "[DONE]"


def test_cancelled_before_start_still_renders() -> None:
    fmt = StreamFormat("chat", "default", 1)
    evs = [
        Event(0, "rejected", code="cancelled", message="cancelled before it started"),
        Event(1, "done", finish_reason="cancelled"),
    ]
    got = render(fmt, evs)
    assert got[0][1]["choices"][0]["delta"]["role"] == "assistant"
    assert got[1][1]["choices"][0]["finish_reason"] == "cancelled"


def test_format_round_trip_and_fallback() -> None:
    fmt = StreamFormat("completion", "m", 12, True)
    assert StreamFormat.decode(fmt.encode(), model="x", created=0) == fmt
    for raw in (None, "", "not json", "[1]", '{"k": "weird", "c": true}'):
        assert StreamFormat.decode(raw, model="x", created=3) == StreamFormat("chat", "x", 3)


def test_collector_chat_and_completion() -> None:
    col = Collector(StreamFormat("chat", "default", 9), SID)
    assert [col.add(ev) for ev in events("Hel", "lo")] == [False, False, False, True]
    assert col.result == {
        "id": "chatcmpl-" + SID,
        "object": "chat.completion",
        "created": 9,
        "model": "default",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }
    col = Collector(StreamFormat("completion", "default", 9), SID)
    for ev in events("a", reason="length"):
        col.add(ev)
    assert col.result is not None
    assert col.result["object"] == "text_completion"
    assert col.result["choices"][0] == {"index": 0, "text": "a", "logprobs": None,
                                        "finish_reason": "length"}  # fmt: skip


@pytest.mark.parametrize(
    ("ev", "status"),
    [
        (Event(0, "rejected", code="bad_request", message="prompt too long"), 400),
        (Event(0, "rejected", code="too_large", message="x"), 413),
        (Event(0, "rejected", code="mystery", message="x"), 500),
        (Event(3, "done", finish_reason="error", message="engine error: RuntimeError"), 500),
        (Event(3, "done", finish_reason="error", message="no engine worker is available"), 503),
    ],
)
def test_collector_errors(ev: Event, status: int) -> None:
    col = Collector(StreamFormat("chat", "default", 9), SID)
    with pytest.raises(ApiError) as info:
        col.add(ev)
    assert info.value.status == status
