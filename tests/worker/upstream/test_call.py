"""One relay call against an upstream that misbehaves: caps, deadlines, max_tokens, ids.

Each test runs a real :class:`Call` over a real socket to a small asyncio server
(fakeupstream.py) and reads what the worker loop would get from the inbox: the
stream refused with a code, or its text and finish. An upstream that never stops
talking must still end the call (within :data:`RUN_WAIT`, far beyond the deadlines
the tests set) and see its connection closed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import pytest

from tests.worker.upstream.fakeupstream import (
    Server,
    chunk,
    delta,
    event,
    serve,
    sse_head,
    trickle,
)
from tokenrelay.core.wire.vocabulary import ErrorCode, FinishReason
from tokenrelay.worker.errors import EngineRefused
from tokenrelay.worker.upstream.call import Call, Upstream
from tokenrelay.worker.upstream.client import HttpClient
from tokenrelay.worker.upstream.config import UpstreamConfig
from tokenrelay.worker.upstream.inbox import Inbox

RUN_WAIT = 20.0  # seconds a call may take here, whatever its upstream does
SID = "s1"
GOOD_ID = "AbCdEfGhIjKlMnOpQrStUv"  # 22 characters, as new_stream_id makes
GOOD_TOKEN = "t" * 43  # as new_resume_token makes


@dataclass
class Outcome:
    """What the worker loop gets of one call."""

    refused: EngineRefused | None = None
    text: str = ""
    finish: FinishReason | None = None
    message: str | None = None
    usage: tuple[int, int] = (0, 0)


async def relay(srv: Server, max_tokens: int = 1000, **settings: Any) -> Outcome:
    """Run one call to ``srv`` with the config ``settings``; what the worker loop gets."""
    cfg = UpstreamConfig(srv.url, model="m", timeout=30.0, **settings)
    http = HttpClient(cfg.url, timeout=cfg.timeout, connect_timeout=2.0, max_connections=4)
    up = Upstream(http, cfg, Inbox(), "m", True)
    up.inbox.add(SID)
    body = {"messages": [{"role": "user", "content": "Hi"}], "params": {"max_tokens": max_tokens}}
    try:
        await asyncio.wait_for(Call(up, SID, body).run(), RUN_WAIT)
        if up.background:
            await asyncio.wait(up.background, timeout=RUN_WAIT)
    finally:
        await http.aclose()
    (opened,) = up.inbox.take_opened()
    if opened.error is not None:
        assert isinstance(opened.error, EngineRefused)
        return Outcome(refused=opened.error)
    up.inbox.attach(SID)
    outs = up.inbox.drain(0)
    assert outs and outs[-1].finished, outs
    last = outs[-1]
    usage = (last.prompt_tokens, last.completion_tokens)
    return Outcome(None, "".join(o.new_text for o in outs), last.finish_reason, last.message, usage)


@dataclass
class Seen:
    """What the fake upstream saw: whether the relay closed the connection on it."""

    closed: bool = False


async def run(head: bytes, parts: Any, every: float = 0.0, **settings: Any) -> tuple[Outcome, Seen]:
    """A call to an upstream that reads the request, then sends ``head`` and each of
    ``parts`` (``every`` seconds apart) until the relay closes the connection."""
    seen = Seen()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(head)
        seen.closed = await trickle(r, w, parts, every)

    async with serve(handler) as srv:
        outcome = await relay(srv, **settings)
        for _ in range(100):  # the server's side of the close, a moment later
            if seen.closed:
                break
            await asyncio.sleep(0.05)
        assert srv.connections == 1  # never tried again
    return outcome, seen


# --- the event stream's caps ------------------------------------------------------------


async def test_an_endless_line_ends_the_stream_at_the_line_cap() -> None:
    endless = itertools.chain([b"data: "], itertools.repeat(b"x" * 16_384, 64))  # 1 MiB
    out, seen = await run(sse_head() + delta("Hi"), (chunk(p) for p in endless),
                          max_line_bytes=65_536)  # fmt: skip
    assert out.text == "Hi" and out.finish == FinishReason.ERROR
    assert out.message is not None and "line over 65536 bytes" in out.message
    assert seen.closed


async def test_an_event_past_its_cap_refuses_the_stream_before_any_text() -> None:
    lines = itertools.repeat(chunk(b"data: " + b"y" * 1000 + b"\n"), 200)  # no blank line
    out, seen = await run(sse_head(), lines, max_event_bytes=16_384)
    assert out.refused is not None and out.refused.code == ErrorCode.UNAVAILABLE
    assert "event over 16384 bytes" in out.refused.message
    assert seen.closed


async def test_comments_in_a_row_end_the_stream_at_their_cap() -> None:
    comments = itertools.repeat(chunk(b": keep-alive\n" * 50), 200)
    out, seen = await run(sse_head() + delta("Hi"), comments, max_idle_run=100)
    assert out.text == "Hi" and out.finish == FinishReason.ERROR
    assert out.message is not None and "over 100 lines in a row" in out.message
    assert seen.closed


async def test_comments_between_empty_events_end_at_the_total_cap() -> None:
    empty = event({"choices": []})  # an event, but nothing in it
    parts = itertools.repeat(chunk(b": keep-alive\n" * 50) + empty, 200)
    out, seen = await run(sse_head(), parts, max_idle_run=100, max_idle_lines=1000)
    assert out.refused is not None and out.refused.code == ErrorCode.UNAVAILABLE
    assert "over 1000 comment or blank lines" in out.refused.message
    assert seen.closed


async def test_informational_answers_past_their_cap_fail_the_call() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 100 Continue\r\n\r\n" * 50 + sse_head() + delta("Hi", "stop")
                + event("[DONE]") + b"0\r\n\r\n")  # fmt: skip
        await w.drain()
        await r.read()

    async with serve(handler) as srv:
        out = await relay(srv)
    assert out.refused is not None and out.refused.code == ErrorCode.UNAVAILABLE
    assert "informational (1xx)" in out.refused.message


# --- deadlines ---------------------------------------------------------------------------


async def test_a_head_trickled_a_byte_at_a_time_meets_the_head_deadline() -> None:
    head = b"HTTP/1.1 200 OK\r\nX-Slow: "
    out, seen = await run(head, itertools.repeat(b"a"), every=0.05, head_timeout=0.5)
    assert out.refused is not None and out.refused.code == ErrorCode.UNAVAILABLE
    assert out.refused.message == "upstream sent no response headers within 0.5 s"
    assert seen.closed


async def test_keep_alives_without_text_meet_the_first_token_deadline() -> None:
    keep_alive = itertools.repeat(chunk(b": keep-alive\n\n"))
    out, seen = await run(sse_head(), keep_alive, every=0.05, head_timeout=0.5,
                          first_token_timeout=1.0)  # fmt: skip
    assert out.refused is not None and out.refused.code == ErrorCode.UNAVAILABLE
    assert out.refused.message == "upstream sent no text within 1 s"
    assert seen.closed


async def test_an_answer_that_never_ends_meets_the_total_deadline() -> None:
    tokens = (delta(f"t{i} ") for i in itertools.count())
    out, seen = await run(sse_head(), tokens, every=0.02, max_tokens=1_000_000,
                          head_timeout=0.5, first_token_timeout=1.0, total_timeout=1.5)  # fmt: skip
    assert out.text.startswith("t0 t1 ") and out.finish == FinishReason.ERROR
    assert out.message is not None and "not over within 1.5 s" in out.message
    assert seen.closed


# --- max_tokens ----------------------------------------------------------------------------


async def test_an_upstream_going_past_max_tokens_is_cut_with_length() -> None:
    tokens = [delta(f"t{i} ") for i in range(50)]
    out, seen = await run(sse_head(), [b"".join(tokens)], max_tokens=5)
    assert out.text == "t0 t1 t2 t3 t4 " and out.finish == FinishReason.LENGTH
    assert out.usage == (0, 5)
    assert seen.closed  # the upstream's answer was closed, not read to its end


async def test_the_upstreams_usage_counts_its_tokens_when_it_gives_it() -> None:
    tokens = [delta(f"t{i} ", usage=(3, 2 * (i + 1))) for i in range(10)]  # two tokens each
    out, _ = await run(sse_head(), [b"".join(tokens)], max_tokens=5)
    assert out.text == "t0 t1 t2 " and out.finish == FinishReason.LENGTH
    assert out.usage == (3, 6)


async def test_an_upstream_that_stops_at_max_tokens_keeps_its_own_finish_and_usage() -> None:
    tokens = [delta(f"t{i} ") for i in range(5)]
    tail = delta(finish="length") + event(
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}
    )
    body = b"".join(tokens) + tail + event("[DONE]") + b"0\r\n\r\n"
    out, _ = await run(sse_head(), [body], max_tokens=5)
    assert out.text == "t0 t1 t2 t3 t4 " and out.finish == FinishReason.LENGTH
    assert out.usage == (7, 5)


# --- a tokenrelay upstream's stream id and resume token ------------------------------------


async def cut_after_text(stream_id: str, token: str) -> tuple[Outcome, list[bytes]]:
    """A stream whose upstream answers with these headers, then dies mid-answer: the
    relay gives up on it and would cancel the upstream's stream. The requests it got."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        raw = await srv.read_request(r)
        if b"/cancel " in raw.split(b"\r\n", 1)[0]:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await w.drain()
            return
        w.write(sse_head(X_Stream_Id=stream_id, X_Resume_Token=token) + delta("Hi"))
        await w.drain()
        w.close()  # mid-answer

    async with serve(handler) as srv:
        out = await relay(srv)
    return out, srv.requests


async def test_a_well_formed_stream_id_and_token_are_used_to_cancel() -> None:
    out, requests = await cut_after_text(GOOD_ID, GOOD_TOKEN)
    assert out.finish == FinishReason.ERROR
    cancels = [r for r in requests if r.startswith(b"POST /v1/streams/")]
    assert len(cancels) == 1 and cancels[0].startswith(
        f"POST /v1/streams/{GOOD_ID}/cancel ".encode()
    )
    assert f"X-Resume-Token: {GOOD_TOKEN}\r\n".encode() in cancels[0]


@pytest.mark.parametrize(
    ("stream_id", "token"),
    [
        ("../../models", GOOD_TOKEN),  # a path of the upstream's own
        ("short", GOOD_TOKEN),
        (GOOD_ID + "/x", GOOD_TOKEN),
        (GOOD_ID, "tok, en"),  # two headers joined
        (GOOD_ID, "t" * 200),
        (GOOD_ID, "tok\ren"),  # a line break into the cancel's headers
    ],
)
async def test_a_malformed_stream_id_or_token_is_logged_and_never_reused(
    stream_id: str, token: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tokenrelay.upstream"):
        out, requests = await cut_after_text(stream_id, token)
    assert out.text == "Hi" and out.finish == FinishReason.ERROR
    assert [r for r in requests if b"/streams/" in r] == []
    said = [r for r in caplog.records if "malformed X-Stream-Id" in r.getMessage()]
    assert len(said) == 1 and getattr(said[0], "stream_id", None) == SID


async def test_an_error_event_that_refuses_the_request_is_its_400_not_tried_again() -> None:
    said = {"error": {"code": 400, "message": "tools are not supported", "type": "server_error"}}
    out, seen = await run(sse_head(), [event(said)])
    assert out.refused is not None and out.refused.code == ErrorCode.BAD_REQUEST
    assert "tools are not supported" in out.refused.message
    assert seen.closed
