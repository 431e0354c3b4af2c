"""The relay's HTTP/1.1 response parser (sans I/O) and its byte-level SSE splitter.

Every response is also fed one byte at a time: where a read happens to end must
not change what comes out.
"""

from __future__ import annotations

import time

import pytest

from tokenrelay.worker.errors import MalformedHttp
from tokenrelay.worker.upstream.http1 import MAX_INTERIM, ResponseParser, request_bytes
from tokenrelay.worker.upstream.openai import SSEStream

CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"X-Stream-Id: s1\r\n\r\n"
    b"6\r\nhello \r\n5;ext=1\r\nworld\r\n0\r\nTrailer: x\r\n\r\n"
)


def pieces(raw: bytes, step: int | None) -> list[bytes]:
    return [raw] if step is None else [raw[i : i + step] for i in range(0, len(raw), step)]


def parse(raw: bytes, *, step: int | None = None) -> tuple[ResponseParser, bytes]:
    p = ResponseParser(method="POST")
    body = b""
    for piece in pieces(raw, step):
        body += p.feed(piece)
    return p, body


@pytest.mark.parametrize("step", [None, 1, 7])
def test_a_chunked_body_comes_out_without_its_framing(step: int | None) -> None:
    p, body = parse(CHUNKED, step=step)
    assert p.head is not None and p.head.status == 200
    assert p.head.get("X-Stream-Id") == "s1"
    assert body == b"hello world"
    assert p.done and p.reusable


@pytest.mark.parametrize("step", [None, 1])
def test_a_content_length_body_ends_at_its_length(step: int | None) -> None:
    raw = b'HTTP/1.1 503 Busy\r\nContent-Length: 13\r\nRetry-After: 1\r\n\r\n{"error":"x"}'
    p, body = parse(raw, step=step)
    assert p.head is not None and (p.head.status, p.head.reason) == (503, "Busy")
    assert p.head.get("retry-after") == "1"
    assert body == b'{"error":"x"}' and p.reusable


def test_a_body_without_length_lasts_until_the_connection_closes() -> None:
    p, body = parse(b"HTTP/1.1 200 OK\r\n\r\nsome")
    assert body == b"some" and not p.done
    p.eof()
    assert p.done and not p.reusable


def test_informational_answers_are_skipped() -> None:
    p, body = parse(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", step=3)
    assert p.head is not None and p.head.status == 204 and p.done and body == b""


def test_informational_answers_past_their_cap_are_a_protocol_error() -> None:
    interim = b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    p, body = parse(interim * MAX_INTERIM + ok, step=5)
    assert p.head is not None and p.head.status == 200 and body == b"ok"
    with pytest.raises(MalformedHttp, match="informational"):
        parse(interim * (MAX_INTERIM + 1) + ok)


@pytest.mark.parametrize("step", [1, 2, 3])
def test_a_head_ended_by_lf_alone_is_found_however_the_reads_split_it(step: int) -> None:
    p, body = parse(b"HTTP/1.1 200 OK\nContent-Length: 4\n\nbody", step=step)
    assert p.head is not None and p.head.get("content-length") == "4" and body == b"body"


def test_connection_close_and_http10_are_not_reused() -> None:
    p, _ = parse(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    assert p.done and not p.reusable
    p, _ = parse(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert p.done and not p.reusable


def test_bytes_beyond_the_end_make_the_connection_unusable() -> None:
    p, body = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA")
    assert body == b"ok" and p.done and not p.reusable


@pytest.mark.parametrize(
    "raw",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n",
    ],
)
def test_what_is_not_http_is_a_protocol_error(raw: bytes) -> None:
    with pytest.raises(MalformedHttp):
        parse(raw)


def test_a_connection_closed_mid_body_is_an_error() -> None:
    p, _ = parse(CHUNKED[:-20])
    with pytest.raises(MalformedHttp):
        p.eof()


def test_a_request_has_its_host_and_length() -> None:
    raw = request_bytes("POST", "/v1/chat/completions", "h:8000", {"A": "b"}, b"{}")
    assert raw == (b"POST /v1/chat/completions HTTP/1.1\r\nHost: h:8000\r\nA: b\r\n"
                   b"Content-Length: 2\r\n\r\n{}")  # fmt: skip
    with pytest.raises(ValueError):
        request_bytes("GET", "/", "h", {"X": "a\r\nInjected: 1"})


EVENTS = (
    'data: {"a":"é"}\n\n'
    ": keep-alive\r\n\r\n"
    "id: 3\rdata: line1\rdata: line2\r\r"
    "event: x\r\ndata: [DONE]\r\n\r\n"
).encode()


@pytest.mark.parametrize("step", [None, 1, 2, 5])
def test_sse_bytes_become_events_however_the_reads_split_them(step: int | None) -> None:
    sse = SSEStream()
    out: list[str] = []
    for piece in pieces(EVENTS, step):
        out += sse.feed(piece)
    assert sse.close() is None
    assert out == ['{"a":"é"}', "line1\nline2", "[DONE]"]


def test_an_event_without_its_last_blank_line_still_counts() -> None:
    sse = SSEStream()
    assert sse.feed(b"data: [DONE]") == []
    assert sse.close() == "[DONE]"


def test_a_line_past_its_cap_is_refused_whether_it_ends_or_not() -> None:
    sse = SSEStream(max_line=1024)
    assert sse.feed(b"data: " + b"x" * 1018) == []  # 1024 bytes, not ended yet: at the cap
    with pytest.raises(ValueError, match="line over 1024 bytes"):
        sse.feed(b"x")
    with pytest.raises(ValueError, match="line over 1024 bytes"):
        SSEStream(max_line=1024).feed(b"data: 1\n\n: " + b"c" * 1100 + b"\n\ndata: 2\n\n")
    with pytest.raises(ValueError, match="line over 1024 bytes"):
        sse = SSEStream(max_line=1024)
        sse.feed(b"data: " + b"x" * 1000)
        sse.feed(b"x" * 100 + b"\n\n")  # the line's end comes, past the cap


def test_a_long_line_costs_time_in_proportion_to_its_length() -> None:
    """Its bytes are not looked at again at each read: 16 MiB in 4 KiB reads stay far
    below the bound (rescanning and rebuilding the buffer each read takes tens of s)."""
    sse = SSEStream(max_line=32 << 20, max_event=32 << 20)
    piece = b"x" * 4096
    began = time.monotonic()
    assert sse.feed(b"data: ") == []
    for _ in range(4096):
        assert sse.feed(piece) == []
    (got,) = sse.feed(b"\r\n\r\n")
    assert len(got) == 16 << 20
    assert time.monotonic() - began < 5.0
