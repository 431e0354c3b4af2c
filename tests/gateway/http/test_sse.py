"""gateway/http/sse.py: SSE framing and the incremental parser."""

from __future__ import annotations

import pytest

from tokenrelay.gateway.http.sse import (
    DONE,
    KEEPALIVE,
    SSEEvent,
    SSEParser,
    comment,
    encode_event,
    parse_event_id,
)


def test_encode_event_with_id_and_multiline_data() -> None:
    assert encode_event("a\nb", id=3) == b"id: 3\ndata: a\ndata: b\n\n"
    assert encode_event("x", event="error") == b"event: error\ndata: x\n\n"
    assert encode_event("héllo", id=0) == "id: 0\ndata: héllo\n\n".encode()
    with pytest.raises(ValueError):
        encode_event("x", id="1\n2")


def test_comment_and_constants() -> None:
    assert comment("keep-alive") == KEEPALIVE
    assert comment() == b":\n"
    assert comment("a\nb") == b": a\n: b\n"
    assert DONE == b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(None, None), ("", None), ("  ", None), ("0", 0), ("17", 17), (" 5 ", 5), ("-1", -1)],
)
def test_parse_event_id(raw: str | None, expected: int | None) -> None:
    assert parse_event_id(raw) == expected


@pytest.mark.parametrize("raw", ["abc", "1.5", "1e3", "--1", "٣", "9" * 40, "0x10"])
def test_parse_event_id_rejects(raw: str) -> None:
    with pytest.raises(ValueError):
        parse_event_id(raw)


def test_parser_round_trip_any_split() -> None:
    stream = (
        encode_event('{"a":"é"}', id=0)
        + KEEPALIVE
        + encode_event("two\nlines", id=1)
        + encode_event("named", event="error")
        + DONE
    )
    expected = [
        SSEEvent('{"a":"é"}', "message", "0"),
        SSEEvent("two\nlines", "message", "1"),
        SSEEvent("named", "error", "1"),
        SSEEvent("[DONE]", "message", "1"),
    ]
    for step in (1, 2, 3, 7, len(stream)):
        parser = SSEParser()
        got = []
        for i in range(0, len(stream), step):
            got += parser.feed(stream[i : i + step])
        assert got == expected, step
        assert parser.comments == 1


def test_parser_line_endings_and_fields() -> None:
    parser = SSEParser()
    events = parser.feed(b"id: 4\r\ndata:x\r\n\r\ndata: y\rdata: z\r\r")
    assert events == [SSEEvent("x", "message", "4")]  # the last CR may be half of a CRLF
    assert parser.feed(b"\n") == [SSEEvent("y\nz", "message", "4")]
    # a CR at the very end waits for a possible LF
    assert parser.feed(b"data: q\r") == []
    assert parser.feed(b"\n\n") == [SSEEvent("q", "message", "4")]
    # an event with no data is not dispatched; unknown fields are ignored
    assert parser.feed(b"event: x\nretry: 10\n\n") == []


def test_openai_sdk_decoder_sees_no_empty_events() -> None:
    """Keep-alives between events with ids must not become empty events in the SDK."""
    from openai._streaming import SSEDecoder

    stream = (
        encode_event('{"a":1}', id=0)
        + KEEPALIVE
        + encode_event('{"b":2}', id=1)
        + KEEPALIVE
        + KEEPALIVE
        + DONE
    )
    for step in (1, 5, len(stream)):
        parts = [stream[i : i + step] for i in range(0, len(stream), step)]
        events = list(SSEDecoder().iter_bytes(iter(parts)))
        assert [e.data for e in events] == ['{"a":1}', '{"b":2}', "[DONE]"]
