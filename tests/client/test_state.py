"""The client's resume state machine, sans I/O: frames in, frames and retries out."""

from __future__ import annotations

from typing import Any

import pytest

from tokenrelay.client import BadRequestError, OverloadedError, RetryPolicy
from tokenrelay.client.frames import (
    Cancelled,
    Done,
    ErrorFrame,
    Resumed,
    Started,
    Token,
    ToolCallDelta,
    Usage,
    generate_frame,
)
from tokenrelay.client.state import Retry, Send, StreamState
from tokenrelay.core.wire.vocabulary import ErrorCode, FinishReason

E = ErrorCode
POLICY = RetryPolicy(limit=2, random=lambda: 0.0)


def new() -> StreamState:
    req = generate_frame(messages=[{"role": "user", "content": "Hi"}], request_id="r1")
    return StreamState(request=req, policy=POLICY)


def started(s: StreamState) -> StreamState:
    assert s.attach() == [s.request]
    assert s.receive(Started("r1", "S", "T", 3)) == []
    return s


def resume(after: int) -> dict[str, Any]:
    return {"type": "resume", "stream_id": "S", "resume_token": "T", "after": after}


def test_a_generate_streams_to_its_done() -> None:
    s = started(new())
    assert (s.stream_id, s.resume_token, s.prompt_tokens, s.started) == ("S", "T", 3, True)
    for seq, text in enumerate(["He", "llo", "!"], 1):
        assert s.receive(Token("S", seq, text)) == []
    assert s.text == "Hello!" and s.last_seq == 3 and not s.finished
    s.receive(Done("S", 4, FinishReason.STOP, Usage(3, 3)))
    assert s.finished and s.finish_reason == FinishReason.STOP and s.usage == Usage(3, 3)
    assert s.last_seq == 4 and s.attach() == [] and s.receive(Token("S", 5, "x")) == []


def test_a_lost_socket_resumes_after_the_last_seq_and_drops_repeats() -> None:
    s = started(new())
    s.receive(Token("S", 1, "a"))
    s.receive(Token("S", 2, "b"))
    s.detach()
    assert s.attach() == [resume(2)]
    s.receive(Resumed("S", 2))
    assert s.receive(Token("S", 2, "b")) == [] and s.duplicates == 1  # a repeat: dropped
    s.receive(Token("S", 3, "c"))
    assert s.text == "abc" and s.resumes == 1


def test_a_gap_asks_for_a_replay_once_and_skips_nothing() -> None:
    s = started(new())
    s.receive(Resumed("S", 0))
    s.receive(Token("S", 1, "a"))
    assert s.receive(Token("S", 3, "c")) == [Send(resume(1))]
    assert s.receive(Token("S", 4, "d")) == []  # already asked: not again
    assert s.gaps == 2 and s.text == "a"
    s.receive(Resumed("S", 1))
    s.receive(Token("S", 2, "b"))
    s.receive(Token("S", 3, "c"))
    assert s.receive(Done("S", 9, FinishReason.STOP, None)) == [Send(resume(3))]
    assert not s.finished and s.text == "abc"


def test_a_generate_without_started_is_sent_again_on_the_next_socket() -> None:
    s = new()
    assert s.attach() == [s.request]
    s.detach()
    assert s.attach() == [s.request]
    assert s.receive(Started("r0", "X", "Y", 1)) == []  # another request's: not ours
    started_ = Started("r1", "S", "T", 3)
    s.receive(started_)
    assert s.receive(Started("r1", "S2", "T2", 3)) == [] and s.stream_id == "S"  # a copy's
    assert s.receive(Token("S2", 1, "x")) == [] and s.text == ""


def test_a_stream_resumed_by_id_starts_from_after_with_its_text() -> None:
    s = StreamState(stream_id="S", resume_token="T", after=5, text="hello")
    assert s.attach() == [resume(5)] and s.text == "hello" and s.chunks == ["hello"]
    s.receive(Token("S", 6, " you"))
    assert s.text == "hello you"
    with pytest.raises(ValueError):
        StreamState(stream_id="S")
    with pytest.raises(ValueError):
        StreamState(stream_id="S", resume_token="T", after=-1)


def test_cancel_goes_out_when_the_stream_can_be_named() -> None:
    s = started(new())
    assert s.cancel() == [{"type": "cancel", "stream_id": "S", "resume_token": "T"}]
    assert s.receive(Cancelled("S", "cancelling", None)) == [] and not s.finished
    s.detach()  # lost before the done: the cancel goes again after the resume
    assert s.attach() == [resume(0), {"type": "cancel", "stream_id": "S", "resume_token": "T"}]
    s.receive(Done("S", 1, FinishReason.CANCELLED, Usage(3, 0)))
    assert s.finish_reason == FinishReason.CANCELLED and s.cancel() == []

    pending = new()
    pending.attach()
    assert pending.cancel() == []  # the generate is out: the cancel follows its started
    cancel = {"type": "cancel", "stream_id": "S", "resume_token": "T"}
    assert pending.receive(Started("r1", "S", "T", 3)) == [Send(cancel)]

    unsent = new()
    assert unsent.cancel() == [] and unsent.finish_reason == FinishReason.CANCELLED
    out = new()
    out.attach()
    out.cancel()
    out.detach()  # never started, nobody wants it: ends here, nothing is sent again
    assert out.attach() == [] and out.finish_reason == FinishReason.CANCELLED


def test_retryable_refusals_are_retried_with_backoff_up_to_the_limit() -> None:
    s = new()
    s.attach()
    assert s.receive(ErrorFrame(E.OVERLOADED, "busy", "r1", None, 1.0)) == [Retry(1.25)]
    assert not s.attached and s.retries == 1
    s.attach()
    assert s.receive(ErrorFrame(E.OVERLOADED, "busy", "r1", None, 1.0)) == [Retry(1.5)]
    s.attach()
    assert s.receive(ErrorFrame(E.OVERLOADED, "busy", "r1", None, 1.0)) == []
    assert isinstance(s.error, OverloadedError) and s.error.retry_after == 1.0
    assert s.finished and s.retries == 2


def test_a_start_or_resume_resets_the_retry_count() -> None:
    s = started(new())
    for _ in range(5):  # Redis down while streaming: resume later, again and again
        assert s.receive(ErrorFrame(E.UNAVAILABLE, "down", None, "S")) == [Retry(2.25)]
        assert s.attach() == [resume(0)]
        s.receive(Resumed("S", 0))
    assert not s.finished and s.retries == 5


def test_a_generate_refused_for_want_of_a_worker_waits_for_one() -> None:
    s = new()
    s.attach()
    assert s.receive(ErrorFrame(E.UNAVAILABLE, "no worker", "r1")) == [Retry(2.25, True)]


def test_a_draining_gateways_refusal_moves_on_at_once_uncounted() -> None:
    s = new()
    s.attach()
    refusal = ErrorFrame(E.UNAVAILABLE, "shutting down", "r1")
    assert s.receive(refusal, draining=True) == [Retry(0.0)] and s.retries == 0


def test_other_errors_end_the_stream_with_their_exception() -> None:
    s = new()
    s.attach()
    s.receive(ErrorFrame(E.BAD_REQUEST, "temperature must be <= 2", "r1"))
    assert isinstance(s.error, BadRequestError) and s.error.request_id == "r1"
    assert s.finished and s.finish_reason is None and s.attach() == []
    t = started(new())
    t.receive(ErrorFrame(E.NOT_FOUND, "expired", None, "S"))
    assert t.error is not None and t.error.stream_id == "S"


def call(cid: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_tool_call_deltas_add_up_once_each_and_done_has_the_last_word() -> None:
    s = started(new())
    s.receive(Token("S", 1, "", None, (ToolCallDelta(0, '{"a":', "c0", "f"),)))
    assert s.tool_calls == [call("c0", "f", '{"a":')]  # the call so far, while streaming
    s.receive(Token("S", 2, "", None, (ToolCallDelta(0, " 1}"), ToolCallDelta(1, "", "c1", "g"))))
    s.detach()
    assert s.attach() == [resume(2)]
    s.receive(Resumed("S", 2))
    s.receive(Token("S", 2, "", None, (ToolCallDelta(0, " 1}"),)))  # replayed: dropped
    s.receive(Token("S", 3, "", None, (ToolCallDelta(1, "{}"),)))
    assert s.tool_calls == [call("c0", "f", '{"a": 1}'), call("c1", "g", "{}")]
    assert [t.seq for t in s.tokens] == [1, 2, 3] and s.duplicates == 1
    s.receive(Done("S", 4, FinishReason.TOOL_CALLS, None, None, [call("c0", "f", '{"a": 1}')]))
    assert s.tool_calls == [call("c0", "f", '{"a": 1}')]  # the done frame's list replaces it


def test_a_resume_by_id_goes_on_from_the_calls_it_holds() -> None:
    held = [call("c0", "f", '{"a"')]
    s = StreamState(stream_id="S", resume_token="T", after=3, tool_calls=held)
    s.receive(Token("S", 4, "", None, (ToolCallDelta(0, ": 1}"),)))
    assert s.tool_calls == [call("c0", "f", '{"a": 1}')] and held == [call("c0", "f", '{"a"')]
