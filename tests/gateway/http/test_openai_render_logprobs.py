"""Logprobs in OpenAI chunks and bodies, and in the WebSocket token frame (no server)."""

from __future__ import annotations

import json
from typing import Any

from tokenrelay.core.wire.events import Event
from tokenrelay.core.wire.logprobs import Logprobs, TokenLogprob, encode_logprobs
from tokenrelay.gateway.http.openai_body import Collector
from tokenrelay.gateway.http.openai_render import ChunkEncoder, StreamFormat
from tokenrelay.gateway.http.sse import SSEParser
from tokenrelay.gateway.session import protocol as p

SID = "abcdefghijklmnop1234"


def tl(token: str, logprob: float) -> TokenLogprob:
    return TokenLogprob(token, logprob, token.encode())


# "Hello world": event 1 "Hello" (one token), event 2 " world" (two tokens " wor" "ld")
E1 = [Logprobs(tl("Hello", -0.1), (tl("Hello", -0.1), tl("Hi", -2.5)))]
E2 = [
    Logprobs(tl(" wor", -0.7), (tl(" wor", -0.7), tl(" there", -1.0))),
    Logprobs(tl("ld", -0.01), (tl("ld", -0.01), tl("lds", -5.0))),
]


def events(with_logprobs: bool = True) -> list[Event]:
    l1 = encode_logprobs(0, E1) if with_logprobs else None
    l2 = encode_logprobs(5, E2) if with_logprobs else None
    return [
        Event(0, "accepted", prompt_tokens=3),
        Event(1, "token", text="Hello", logprobs=l1),
        Event(2, "token", text=" world", logprobs=l2),
        Event(3, "done", finish_reason="length", prompt_tokens=3, completion_tokens=3),
    ]


def chunks(fmt: StreamFormat, evs: list[Event]) -> list[Any]:
    enc = ChunkEncoder(fmt, SID)
    parser = SSEParser()
    out = []
    for ev in evs:
        for sse in parser.feed(enc.encode(ev)):
            if sse.data != "[DONE]":
                out.append(json.loads(sse.data))
    return out


def collect(fmt: StreamFormat, evs: list[Event]) -> dict[str, Any]:
    col = Collector(fmt, SID)
    for ev in evs:
        col.add(ev)
    assert col.result is not None
    return col.result


def test_chat_chunks_and_body() -> None:
    fmt = StreamFormat("chat", "default", 1, logprobs=True)
    got = chunks(fmt, events())
    assert got[0]["choices"][0]["logprobs"] is None  # the role chunk
    first = got[1]["choices"][0]["logprobs"]
    assert first["refusal"] is None
    assert first["content"] == [
        {
            "token": "Hello",
            "logprob": -0.1,
            "bytes": list(b"Hello"),
            "top_logprobs": [
                {"token": "Hello", "logprob": -0.1, "bytes": list(b"Hello")},
                {"token": "Hi", "logprob": -2.5, "bytes": list(b"Hi")},
            ],
        }
    ]
    assert [c["token"] for c in got[2]["choices"][0]["logprobs"]["content"]] == [" wor", "ld"]
    assert got[3]["choices"][0]["logprobs"] is None  # the finish chunk
    body = collect(fmt, events())
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hello", " wor", "ld"]
    assert "".join(c["token"] for c in content) == body["choices"][0]["message"]["content"]


def test_completion_chunks_and_body() -> None:
    fmt = StreamFormat("completion", "default", 1, logprobs=True)
    got = chunks(fmt, events())
    second = got[1]["choices"][0]["logprobs"]
    assert second == {
        "tokens": [" wor", "ld"],
        "token_logprobs": [-0.7, -0.01],
        "top_logprobs": [{" wor": -0.7, " there": -1.0}, {"ld": -0.01, "lds": -5.0}],
        "text_offset": [5, 9],
    }
    body = collect(fmt, events())["choices"][0]
    assert body["text"] == "Hello world"
    assert body["logprobs"]["tokens"] == ["Hello", " wor", "ld"]
    assert body["logprobs"]["text_offset"] == [0, 5, 9]
    assert body["logprobs"]["token_logprobs"] == [-0.1, -0.7, -0.01]


def test_resumed_stream_renders_the_same_offsets() -> None:
    fmt = StreamFormat("completion", "default", 1, logprobs=True)
    whole = chunks(fmt, events())
    resumed = chunks(fmt, events()[2:])  # Last-Event-ID: 1
    assert resumed[0] == whole[1]  # (no role chunk in completions)


def test_not_asked_means_null_and_format_round_trip() -> None:
    for kind in ("chat", "completion"):
        fmt = StreamFormat(kind, "default", 1)
        assert all(
            c["choices"][0]["logprobs"] is None for c in chunks(fmt, events(False)) if c["choices"]
        )
        assert collect(fmt, events())["choices"][0]["logprobs"] is None
        asked = StreamFormat(kind, "default", 1, logprobs=True)
        assert StreamFormat.decode(asked.encode(), model="m", created=0) == asked
        assert StreamFormat.decode(fmt.encode(), model="m", created=0) == fmt
    # a completion with no token at all still has every key
    fmt = StreamFormat("completion", "default", 1, logprobs=True)
    empty = [Event(0, "accepted"), Event(1, "done", finish_reason="stop")]
    assert collect(fmt, empty)["choices"][0]["logprobs"] == {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }


def test_websocket_token_frame() -> None:
    raw = encode_logprobs(0, E1)
    frame = json.loads(p.encode_token(SID, 4, "Hello", raw))
    assert frame == p.token_frame(SID, 4, "Hello", raw)
    assert frame["type"] == "token" and frame["text"] == "Hello" and frame["seq"] == 4
    assert frame["logprobs"][0]["token"] == "Hello"
    assert frame["logprobs"][0]["top_logprobs"][1] == {
        "token": "Hi",
        "logprob": -2.5,
        "bytes": list(b"Hi"),
    }
    assert "logprobs" not in json.loads(p.encode_token(SID, 4, "Hello"))


def test_a_websocket_stream_resumed_over_http_shows_its_logprobs() -> None:
    fmt = StreamFormat.decode(None, model="default", created=1)  # no stored format: chat
    got = chunks(fmt, events())
    assert [c["token"] for c in got[2]["choices"][0]["logprobs"]["content"]] == [" wor", "ld"]
    assert all(c["choices"][0]["logprobs"] is None for c in chunks(fmt, events(False)))
