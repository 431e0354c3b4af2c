"""core/wire/logprobs.py and the token event's ``l`` field: stored compactly, read back,
rendered in OpenAI's shapes; old readers and old events unaffected."""

from __future__ import annotations

import json

import pytest

from tokenrelay.core.wire.events import TOKEN, decode_event, event_from_fields, token_fields
from tokenrelay.core.wire.logprobs import (
    LOGPROB_FLOOR,
    Logprobs,
    TokenLogprob,
    chat_content,
    completion_logprobs,
    decode_logprobs,
    encode_logprobs,
)
from tokenrelay.core.wire.scripts import decode_published


def tl(token: str, logprob: float, raw: bytes | None = None) -> TokenLogprob:
    return TokenLogprob(token, logprob, token.encode() if raw is None else raw)


ENTRIES = [
    Logprobs(tl(" Hel", -0.25), (tl(" Hel", -0.25), tl(" Hi", -1.5))),
    Logprobs(tl("\ufffd", -2.0, b"\xe2\x80"), (tl("\ufffd", -2.0, b"\xe2\x80"),)),
    Logprobs(tl("\ufffd", -0.5, b"\x9c"), ()),
    Logprobs(tl("x", float("-inf")), (tl("y", float("nan")),)),
]


def test_round_trip_keeps_text_bytes_and_values() -> None:
    raw = encode_logprobs(7, ENTRIES)
    offset, back = decode_logprobs(raw)
    assert offset == 7 and len(back) == 4
    assert back[:3] == ENTRIES[:3]
    assert back[3].chosen.logprob == LOGPROB_FLOOR and back[3].top[0].logprob == LOGPROB_FLOOR
    # bytes are stored only when they are not the text's UTF-8
    stored = json.loads(raw)
    assert stored[1][0] == [[" Hel", -0.25], [[" Hel", -0.25], [" Hi", -1.5]]]
    assert stored[1][1][0] == ["\ufffd", -2.0, [0xE2, 0x80]]


@pytest.mark.parametrize("raw", [None, "", "{", "[1]", '[1, [["a"]]]', '["x", []]', "[1, 5]"])
def test_malformed_fields_read_as_none(raw: str | None) -> None:
    assert decode_logprobs(raw) == (0, [])


def test_chat_content_shape() -> None:
    out = chat_content(ENTRIES[:2])
    assert out[0] == {
        "token": " Hel",
        "logprob": -0.25,
        "bytes": [32, 72, 101, 108],
        "top_logprobs": [
            {"token": " Hel", "logprob": -0.25, "bytes": [32, 72, 101, 108]},
            {"token": " Hi", "logprob": -1.5, "bytes": [32, 72, 105]},
        ],
    }
    assert out[1]["bytes"] == [0xE2, 0x80]
    # the parts' bytes join into the character
    assert bytes(out[1]["bytes"] + chat_content(ENTRIES[2:3])[0]["bytes"]).decode() == "\u201c"


def test_completion_shape_offsets_and_chosen_in_top() -> None:
    out = completion_logprobs(10, " Hel\u201c", ENTRIES[:3])
    assert out["tokens"] == [" Hel", "\ufffd", "\ufffd"]
    assert out["token_logprobs"] == [-0.25, -2.0, -0.5]
    assert out["top_logprobs"] == [
        {" Hel": -0.25, " Hi": -1.5},
        {"\ufffd": -2.0},
        {"\ufffd": -0.5},  # no alternatives asked: the chosen token still shows
    ]
    assert out["text_offset"] == [10, 14, 15]  # never past the event's text


def test_token_events_carry_the_field_and_old_ones_still_read() -> None:
    raw = encode_logprobs(0, ENTRIES[:1])
    fields = token_fields("Hi", raw)
    assert fields == ["k", TOKEN, "x", "Hi", "l", raw]
    assert token_fields("Hi") == ["k", TOKEN, "x", "Hi"]  # unchanged without logprobs
    ev = event_from_fields(3, dict(zip(fields[0::2], fields[1::2], strict=True)))
    assert ev.kind == "token" and ev.text == "Hi" and ev.logprobs == raw
    old = decode_event(b"4-1", {b"k": b"t", b"x": b"Hi"})
    assert old.logprobs is None and old.text == "Hi"


def test_published_events_keep_the_field() -> None:
    raw = encode_logprobs(2, ENTRIES[:2])
    payload = json.dumps([123, [["sid", 5, [token_fields("a", raw), token_fields("b")]]]])
    _, streams = decode_published(payload)
    (_, _, events) = streams[0]
    assert [e.logprobs for e in events] == [raw, None]
    assert [e.seq for e in events] == [5, 6]
