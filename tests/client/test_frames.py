"""The client's frames, sans I/O: built as docs/protocol.md says, decoded leniently."""

from __future__ import annotations

import json

import pytest

from tokenrelay.client.frames import (
    Cancelled,
    Done,
    ErrorFrame,
    Hello,
    Notice,
    Pong,
    Resumed,
    Started,
    Token,
    ToolCallDelta,
    Unknown,
    Usage,
    cancel_frame,
    decode,
    encode,
    generate_frame,
    new_request_id,
    resume_frame,
)
from tokenrelay.core.wire.vocabulary import ErrorCode, FinishReason

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_generate_carries_messages_or_prompt_and_the_params_as_they_are() -> None:
    f = generate_frame(messages=MESSAGES, params={"max_tokens": 8, "stop": ["\n"]},
                       request_id="r1", model="m", traceparent="00-x")  # fmt: skip
    assert f == {"type": "generate", "request_id": "r1", "messages": MESSAGES,
                 "params": {"max_tokens": 8, "stop": ["\n"]}, "model": "m",
                 "traceparent": "00-x"}  # fmt: skip
    raw = generate_frame(prompt="Once", params={})
    assert raw["prompt"] == "Once" and "params" not in raw and "messages" not in raw
    assert raw["request_id"].startswith("r-") and raw["request_id"] != new_request_id()
    assert "n" not in generate_frame(prompt="x", params={"n": 1}).get("params", {})


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"messages": MESSAGES, "prompt": "x"}, {"prompt": "x", "params": {"n": 2}}],
)
def test_generate_refuses_what_one_stream_cannot_be(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        generate_frame(**kwargs)


def test_resume_cancel_and_encode() -> None:
    assert resume_frame("S", "T", 7) == {"type": "resume", "stream_id": "S",
                                         "resume_token": "T", "after": 7}  # fmt: skip
    assert cancel_frame("S", None) == {"type": "cancel", "stream_id": "S"}
    assert cancel_frame("S", "T")["resume_token"] == "T"
    text = encode({"type": "generate", "prompt": "héllo"})
    assert text == '{"type":"generate","prompt":"héllo"}'


def test_every_server_frame_decodes_to_its_record() -> None:
    def d(**f: object) -> object:
        return decode(json.dumps(f))

    hello = d(type="hello", protocol=1, heartbeat_s=20.0, max_frame_bytes=1024,
              server="tokenrelay/0.1.0", worker_ready=False, extra=1)  # fmt: skip
    assert hello == Hello(1, 20.0, 1024, "tokenrelay/0.1.0", False)
    assert d(type="started", request_id="r1", stream_id="S", resume_token="T",
             prompt_tokens=5) == Started("r1", "S", "T", 5)  # fmt: skip
    assert d(type="token", stream_id="S", seq=3, text="a") == Token("S", 3, "a")
    lp = [{"token": "a", "logprob": -0.1}]
    assert d(type="token", stream_id="S", seq=1, text="a", logprobs=lp) == Token("S", 1, "a", lp)
    done = d(type="done", stream_id="S", seq=9, finish_reason="length",
             usage={"prompt_tokens": 4, "completion_tokens": 8})  # fmt: skip
    assert done == Done("S", 9, FinishReason.LENGTH, Usage(4, 8))
    assert isinstance(done, Done) and done.usage is not None and done.usage.total_tokens == 12
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    tool = d(type="done", stream_id="S", seq=2, finish_reason="tool_calls", tool_calls=calls)
    assert isinstance(tool, Done) and tool.tool_calls == calls
    assert tool.finish_reason == FinishReason.TOOL_CALLS
    assert d(type="resumed", stream_id="S", after=4) == Resumed("S", 4)
    assert d(type="cancelled", stream_id="S", state="finished",
             finish_reason="stop") == Cancelled("S", "finished", FinishReason.STOP)  # fmt: skip
    over = d(type="error", code="overloaded", message="busy", request_id="r1", retry_after=2)
    assert over == ErrorFrame(ErrorCode.OVERLOADED, "busy", "r1", None, 2.0)
    notice = d(type="notice", code="shutting_down", message="m", drain_s=30)
    assert notice == Notice("shutting_down", "m", 30.0)
    assert d(type="pong") == Pong()


def test_a_token_frames_tool_calls_decode_to_deltas() -> None:
    first = {"index": 0, "id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": ""}}  # fmt: skip
    more = {"index": 0, "function": {"arguments": '{"zone": '}}
    f = decode(json.dumps({"type": "token", "stream_id": "S", "seq": 4, "text": "",
                           "tool_calls": [first, more]}))  # fmt: skip
    assert f == Token("S", 4, "", None, (ToolCallDelta(0, "", "call_1", "get_time"),
                                         ToolCallDelta(0, '{"zone": ')))  # fmt: skip
    # lenient: an entry with no index is skipped, a missing function is no fragment
    bad = [{"function": {"arguments": "x"}}, {"index": 1}, "nope"]
    f = decode(json.dumps({"type": "token", "stream_id": "S", "seq": 5, "tool_calls": bad}))
    assert f == Token("S", 5, "", None, (ToolCallDelta(1, ""),))


def test_decoding_is_lenient() -> None:
    assert isinstance(decode("not json"), Unknown)
    assert isinstance(decode("[1, 2]"), Unknown)
    assert isinstance(decode('{"type": "telepathy"}'), Unknown)  # a frame of a newer server
    assert isinstance(decode('{"type": "token", "stream_id": "S", "seq": "1"}'), Unknown)
    err = decode('{"type": "error", "code": "gremlins", "retry_after": true}')
    assert err == ErrorFrame(ErrorCode.INTERNAL, "error")  # an unknown code is internal
    done = decode('{"type": "done", "stream_id": "S", "finish_reason": "eclipse"}')
    assert isinstance(done, Done) and done.finish_reason == "eclipse" and done.seq is None
    assert decode('{"type": "hello"}') == Hello(0, None, None, None, True)
