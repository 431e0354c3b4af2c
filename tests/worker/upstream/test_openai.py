"""OpenAI's streaming shapes as the relay writes and reads them: bodies, events, chunks."""

from __future__ import annotations

import json

import pytest

from tokenrelay.core.wire.logprobs import LOGPROB_FLOOR, Logprobs, TokenLogprob
from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.tools import MAX_CALL_CHARS, MAX_CALLS, CallDelta, ToolCall, call_id
from tokenrelay.worker.errors import Refused, Retryable
from tokenrelay.worker.upstream.features import CallReader, RawDelta
from tokenrelay.worker.upstream.openai import (
    SSEDecoder,
    mentions_stream_options,
    parse_chunk,
    request_body,
    sampling_fields,
    status_error,
    unrelayed,
)


def test_a_chat_body_goes_to_chat_completions_with_only_the_fields_set() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    path, out = request_body(body, SamplingParams(max_tokens=5, temperature=0), "m",
                             include_usage=True)  # fmt: skip
    assert path == "/chat/completions"
    assert out == {"model": "m", "messages": body["messages"], "stream": True,
                   "stream_options": {"include_usage": True}, "max_tokens": 5,
                   "temperature": 0.0}  # fmt: skip


def test_a_prompt_body_goes_to_completions_with_its_sampling_extensions() -> None:
    params = SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, top_k=40, seed=1,
                            stop=["\n"], min_p=0.1, logit_bias={7: -5.0},
                            stop_token_ids=[2], ignore_eos=True)  # fmt: skip
    path, out = request_body({"prompt": "x"}, params, None, include_usage=False)
    assert path == "/completions" and "model" not in out and "stream_options" not in out
    assert out["prompt"] == "x" and out["top_k"] == 40 and out["seed"] == 1
    assert out["stop"] == ["\n"] and out["min_p"] == 0.1 and out["logit_bias"] == {"7": -5.0}
    assert out["stop_token_ids"] == [2] and out["ignore_eos"] is True
    assert "presence_penalty" not in out and "repetition_penalty" not in out


def test_logprobs_are_asked_for_in_each_endpoints_own_shape() -> None:
    msgs = {"messages": [{"role": "user", "content": "Hi"}]}
    _, chat = request_body(msgs, SamplingParams(logprobs=3), None, include_usage=False)
    assert chat["logprobs"] is True and chat["top_logprobs"] == 3
    _, plain = request_body({"prompt": "x"}, SamplingParams(logprobs=2), None,
                            include_usage=False)  # fmt: skip
    assert plain["logprobs"] == 2 and "top_logprobs" not in plain
    _, none = request_body(msgs, SamplingParams(), None, include_usage=False)
    assert "logprobs" not in none and "top_logprobs" not in none


def test_a_chunks_logprobs_become_the_values_the_worker_stores() -> None:
    top = [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]},
           {"token": "\ufffd", "logprob": -2.5, "bytes": [226, 128]}]  # fmt: skip
    content = [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": top},
               {"token": "!", "logprob": -99999.0, "bytes": None,
                "top_logprobs": []},
               {"token": 3, "logprob": -1.0}, "junk"]  # fmt: skip
    got = parse_chunk(chunk(delta={"content": "Hi!"}, logprobs={"content": content}))
    assert got.text == "Hi!" and len(got.logprobs) == 2  # what is not an item is read past
    first, second = got.logprobs
    assert first == Logprobs(TokenLogprob("Hi", -0.1, b"Hi"),
                             (TokenLogprob("Hi", -0.1, b"Hi"),
                              TokenLogprob("\ufffd", -2.5, b"\xe2\x80")))  # fmt: skip
    assert second.chosen == TokenLogprob("!", LOGPROB_FLOOR, b"!") and second.top == ()
    completion = {"tokens": [" Paris", "."], "token_logprobs": [-0.5, -1.5],
                  "top_logprobs": [{" Paris": -0.5, " Lyon": -2.0}, {".": -1.5}],
                  "text_offset": [0, 6]}  # fmt: skip
    got = parse_chunk(chunk(text=" Paris.", logprobs=completion))
    assert [e.chosen.token for e in got.logprobs] == [" Paris", "."]
    assert [t.token for t in got.logprobs[0].top] == [" Paris", " Lyon"]  # most likely first
    assert got.logprobs[0].chosen.raw == b" Paris"
    assert parse_chunk(chunk(delta={"content": "x"}, logprobs=None)).logprobs == []


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


def test_tools_go_to_chat_completions_only() -> None:
    msgs = {"messages": [{"role": "user", "content": "Hi"}]}
    params = SamplingParams(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    _, out = request_body(msgs, params, None, include_usage=False)
    assert out["tools"] == params.tools and out["tool_choice"] == "required"
    assert out["parallel_tool_calls"] is False
    named = {"type": "function", "function": {"name": "get_weather"}}
    _, out = request_body(msgs, SamplingParams(tools=[TOOL], tool_choice=named), None,
                          include_usage=False)  # fmt: skip
    assert out["tool_choice"] == named and "parallel_tool_calls" not in out
    assert unrelayed(params) == []
    assert unrelayed(params, chat=False) == ["tools", "tool_choice", "parallel_tool_calls"]


def test_streamed_tool_calls_are_numbered_named_once_and_joined() -> None:
    def calls(*items: dict[str, object]) -> list[RawDelta]:
        return parse_chunk(chunk(delta={"tool_calls": list(items)})).calls

    first = calls({"index": 0, "id": "up_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": ""}})  # fmt: skip
    assert first == [(0, "get_weather", "")]
    assert calls({"index": 0, "function": {"arguments": '{"city": '}}) == [(0, None, '{"city": ')]
    assert calls("junk", {"index": True, "function": {"arguments": {"a": 1}}}) == [
        (None, None, '{"a": 1}')]  # fmt: skip
    assert parse_chunk(chunk(delta={"content": "x"})).calls == []
    reader = CallReader()
    assert reader.feed(first) == [CallDelta(0, "get_weather", "")]
    assert reader.feed([(0, None, '{"city": '), (0, None, '"Paris"}')]) == [
        CallDelta(0, None, '{"city": '), CallDelta(0, None, '"Paris"}')]  # fmt: skip
    assert reader.feed([(5, None, '{"q"'), (0, None, "")]) == []  # held: no name yet
    assert reader.feed([(5, "search", ': "x"}')]) == [CallDelta(1, "search", '{"q": "x"}')]
    assert reader.feed([(None, "get_weather", "{}"), (None, None, " ")]) == [
        CallDelta(2, "get_weather", "{}"), CallDelta(2, None, " ")]  # fmt: skip
    assert reader.calls("s1") == (
        ToolCall(call_id("s1", 0), "get_weather", '{"city": "Paris"}'),
        ToolCall(call_id("s1", 1), "search", '{"q": "x"}'),
        ToolCall(call_id("s1", 2), "get_weather", "{} "),
    )


def test_tool_calls_past_their_caps_end_the_read() -> None:
    reader = CallReader()
    reader.feed([(i, "f", "{}") for i in range(MAX_CALLS)])
    with pytest.raises(ValueError, match=f"over {MAX_CALLS} tool calls"):
        reader.feed([(MAX_CALLS, "f", "{}")])
    reader = CallReader()
    reader.feed([(0, "f", "x" * MAX_CALL_CHARS)])
    with pytest.raises(ValueError, match=f"over {MAX_CALL_CHARS} characters"):
        reader.feed([(0, None, "x")])
    with pytest.raises(ValueError, match=f"over {MAX_CALL_CHARS} characters"):
        CallReader().feed([(1, None, "x" * (MAX_CALL_CHARS + 1))])


def chunk(**choice: object) -> str:
    return json.dumps({"choices": [{"index": 0, **choice}], "usage": None})


def test_chunks_give_text_finish_usage_errors_and_done() -> None:
    assert parse_chunk(chunk(delta={"role": "assistant", "content": ""})).text == ""
    assert parse_chunk(chunk(delta={"content": "Hi"})).text == "Hi"
    assert parse_chunk(chunk(text="lo", finish_reason=None)).text == "lo"
    assert parse_chunk(chunk(delta={}, finish_reason="length")).finish_reason == "length"
    assert parse_chunk(chunk(delta={}, finish_reason="eos_token")).finish_reason == "stop"
    assert parse_chunk(chunk(delta={}, finish_reason="tool_calls")).finish_reason == "tool_calls"
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert parse_chunk(json.dumps({"choices": [], "usage": usage})).usage == (3, 4)
    err = parse_chunk(json.dumps({"error": {"message": "boom", "type": "server_error"}}))
    assert err.error == "boom"
    assert parse_chunk("[DONE]").done
    with pytest.raises(ValueError):
        parse_chunk("not json")
    with pytest.raises(ValueError):
        parse_chunk("[1, 2]")


def test_an_error_event_refuses_when_it_says_what_a_4xx_says() -> None:
    def refusal(err: object) -> str | None:
        return parse_chunk(json.dumps({"error": err})).refusal

    assert refusal({"message": "no", "code": 400, "type": "BadRequestError"}) == "bad_request"
    assert refusal({"message": "no", "code": "422"}) == "bad_request"
    assert refusal({"message": "big", "code": 413}) == "too_large"
    assert refusal({"message": "no", "type": "invalid_request_error"}) == "bad_request"
    assert refusal({"message": "big", "code": "too_large"}) == "too_large"  # tokenrelay's
    for transient in ({"message": "x", "code": 500}, {"message": "x", "code": 429},
                      {"message": "x", "code": 404}, {"message": "x"}, "boom"):  # fmt: skip
        assert refusal(transient) is None, transient


def test_statuses_map_onto_retry_or_refuse_with_the_upstreams_words() -> None:
    e = status_error(503, b'{"error": {"message": "no worker"}}', 2.0)
    assert isinstance(e, Retryable) and e.code == "unavailable" and e.retry_after == 2.0
    assert "HTTP 503: no worker" in e.message
    e = status_error(429, b'{"error": "slow down"}', None)  # TGI's shape
    assert isinstance(e, Retryable) and e.code == "overloaded" and "slow down" in e.message
    e = status_error(400, b'{"detail": "bad stream_options"}', None)
    assert isinstance(e, Refused) and e.code == "bad_request" and mentions_stream_options(e)
    e = status_error(413, b"too big", None)
    assert isinstance(e, Refused) and e.code == "too_large" and "too big" in e.message
    e = status_error(401, b"", None)
    assert isinstance(e, Refused) and e.code == "unavailable" and "--upstream-api-key" in e.message


def test_a_field_the_relay_cannot_pass_on_is_named_not_dropped() -> None:
    assert unrelayed(SamplingParams(max_tokens=3, top_k=5, seed=2, stop=["x"])) == []
    assert unrelayed(SamplingParams(logprobs=0)) == []
    fmt = {"type": "json_object"}
    assert unrelayed(SamplingParams(response_format=fmt)) == []
    assert sampling_fields(SamplingParams(response_format=fmt))["response_format"] == fmt


def feed(lines: list[str]) -> list[str]:
    d = SSEDecoder()
    out = [data for line in lines if (data := d.feed(line.encode())) is not None]
    last = d.close()
    return [*out, last] if last is not None else out


def test_events_end_at_blank_lines_and_comments_ids_and_names_are_read_past() -> None:
    lines = [": keep-alive", "", "id: 1", "event: message", 'data: {"a":1}', "",
             "retry: 10", "data:[DONE]", ""]  # fmt: skip
    assert feed(lines) == ['{"a":1}', "[DONE]"]


def test_multi_line_data_is_joined_with_newlines_and_one_leading_space_is_dropped() -> None:
    assert feed(["data: a", "data:  b", "data:c", ""]) == ["a\n b\nc"]


def test_an_event_the_stream_ends_without_a_blank_line_is_still_delivered() -> None:
    assert feed(["data: x", "", "data: [DONE]"]) == ["x", "[DONE]"]
    assert feed([]) == []


def test_an_event_past_its_cap_is_refused_and_one_at_it_is_not() -> None:
    d = SSEDecoder(max_event=1024)
    assert d.feed(b"data: " + b"a" * 500) is None
    assert d.feed(b"data: " + b"b" * 522) is None  # 500 + 522 + two line ends: 1024
    assert d.feed(b"") == "a" * 500 + "\n" + "b" * 522
    d.feed(b"data: " + b"a" * 1000)
    with pytest.raises(ValueError, match="event over 1024 bytes"):
        d.feed(b"data: " + b"a" * 100)


def test_empty_data_lines_count_towards_the_event_cap_and_the_idle_caps() -> None:
    d = SSEDecoder(max_idle_run=1_000_000, max_idle_lines=1_000_000, max_event=4096)
    with pytest.raises(ValueError, match="event over 4096 bytes"):
        for _ in range(5000):
            d.feed(b"data:")
    d = SSEDecoder(max_idle_run=100)
    with pytest.raises(ValueError, match="over 100 lines in a row"):
        for _ in range(101):
            d.feed(b"data:")


def test_lines_without_an_event_are_capped_in_a_row_and_in_total() -> None:
    d = SSEDecoder(max_idle_run=10, max_idle_lines=1_000)
    for _ in range(10):
        d.feed(b": keep-alive")
    assert d.feed(b"data: x") is None and d.feed(b"") == "x"  # an event: the run starts again
    for _ in range(5):
        d.feed(b"id: 7")
        d.feed(b"")
    with pytest.raises(ValueError, match="over 10 lines in a row without an event"):
        d.feed(b"event: x")
    d = SSEDecoder(max_idle_run=10, max_idle_lines=30)
    with pytest.raises(ValueError, match="over 30 comment or blank lines"):
        for _ in range(11):  # three such lines each
            for line in (b": a", b": b", b"", b'data: {"choices":[]}', b""):
                d.feed(line)


def test_event_ids_and_names_never_count_towards_the_total_cap() -> None:
    d = SSEDecoder(max_idle_lines=10)
    events = 0
    for i in range(20_000):  # what a long answer from a tokenrelay upstream looks like
        for line in (b"id: %d" % i, b"event: message", b'data: {"choices":[]}', b""):
            events += d.feed(line) is not None
    assert events == 20_000
