"""Protocol v1, sans I/O: every client frame parsed or refused with the right code."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenrelay.gateway.session import protocol as p

SID = "A" * 22


def parse(obj: object, limits: p.Limits | None = None) -> p.ClientFrame:
    return p.parse_frame(json.dumps(obj), limits)


def error_of(obj: object, limits: p.Limits | None = None) -> p.ProtocolError:
    with pytest.raises(p.ProtocolError) as info:
        parse(obj, limits) if not isinstance(obj, str) else p.parse_frame(obj, limits)
    assert info.value.code in p.ERROR_CODES
    return info.value


def test_generate_with_messages() -> None:
    frame = parse(
        {
            "type": "generate",
            "request_id": "r1",
            "messages": [
                {"role": "system", "content": "Be brief"},
                {"role": "user", "content": "Hi"},
            ],
            "params": {"max_tokens": 8, "temperature": 0, "stop": ["\n"], "seed": 3},
        }
    )
    assert isinstance(frame, p.Generate)
    assert frame.request_id == "r1"
    assert frame.messages == (p.Message("system", "Be brief"), p.Message("user", "Hi"))
    assert frame.params.max_tokens == 8 and frame.params.greedy and frame.params.stop == ["\n"]
    body = frame.body()
    assert body["messages"][1] == {"role": "user", "content": "Hi"}
    assert body["params"]["seed"] == 3 and "prompt" not in body


def test_generate_with_prompt_and_defaults() -> None:
    frame = parse({"type": "generate", "prompt": "Once upon"})
    assert isinstance(frame, p.Generate)
    assert frame.request_id is None and frame.prompt == "Once upon" and frame.messages is None
    assert frame.params.max_tokens == 256
    assert frame.body() == {"prompt": "Once upon", "params": frame.body()["params"]}


def test_unknown_top_level_fields_are_ignored() -> None:
    assert isinstance(parse({"type": "ping", "extra": [1, 2]}), p.Ping)
    frame = parse({"type": "generate", "prompt": "x", "future_field": True})
    assert isinstance(frame, p.Generate)


@pytest.mark.parametrize(
    ("obj", "code", "needle"),
    [
        ("not json", "bad_request", "not valid JSON"),
        ("{", "bad_request", "not valid JSON"),
        ('{"type": "ping", "x": NaN}', "bad_request", "not valid JSON"),
        ("[1, 2]", "bad_request", "JSON object"),
        ('"ping"', "bad_request", "JSON object"),
        ("{}", "bad_request", "missing field 'type'"),
        ('{"type": 5}', "bad_request", "'type' must be a string"),
        ('{"type": "launch"}', "bad_request", "unknown frame type"),
        ('{"type": "generate"}', "bad_request", "missing field 'messages'"),
        ('{"type": "generate", "prompt": "a", "messages": []}', "bad_request", "not both"),
        ('{"type": "generate", "prompt": 7}', "bad_request", "prompt must be a string"),
        ('{"type": "generate", "prompt": ""}', "bad_request", "must not be empty"),
        ('{"type": "generate", "messages": "hi"}', "bad_request", "must be a list"),
        ('{"type": "generate", "messages": []}', "bad_request", "must not be empty"),
        ('{"type": "generate", "messages": [5]}', "bad_request", "messages[0] must be an object"),
        (
            '{"type": "generate", "messages": [{"role": "god", "content": "x"}]}',
            "bad_request",
            "role",
        ),
        ('{"type": "generate", "messages": [{"role": "user"}]}', "bad_request", "content"),
        (
            '{"type": "generate", "messages": [{"role": "user", "content": 1}]}',
            "bad_request",
            "content",
        ),
        (
            '{"type": "generate", "prompt": "a", "params": []}',
            "bad_request",
            "params must be an object",
        ),
        (
            '{"type": "generate", "prompt": "a", "params": {"max_token": 5}}',
            "bad_request",
            "max_token",
        ),
        (
            '{"type": "generate", "prompt": "a", "params": {"max_tokens": 0}}',
            "bad_request",
            "max_tokens",
        ),
        (
            '{"type": "generate", "prompt": "a", "params": {"max_tokens": "9"}}',
            "bad_request",
            "max_tokens",
        ),
        (
            '{"type": "generate", "prompt": "a", "params": {"max_tokens": 99999}}',
            "bad_request",
            "max_tokens",
        ),
        (
            '{"type": "generate", "prompt": "a", "params": {"temperature": -1}}',
            "bad_request",
            "temperature",
        ),
        ('{"type": "generate", "prompt": "a", "params": {"top_p": 0}}', "bad_request", "top_p"),
        ('{"type": "generate", "prompt": "a", "params": {"top_k": 1.5}}', "bad_request", "top_k"),
        ('{"type": "generate", "prompt": "a", "params": {"seed": -1}}', "bad_request", "seed"),
        ('{"type": "generate", "prompt": "a", "params": {"seed": true}}', "bad_request", "seed"),
        ('{"type": "generate", "prompt": "a", "params": {"stop": [1]}}', "bad_request", "stop"),
        ('{"type": "generate", "prompt": "a", "params": {"stop": [""]}}', "bad_request", "stop"),
        (
            '{"type": "generate", "prompt": "a", "params": {"ignore_eos": 1}}',
            "bad_request",
            "ignore_eos",
        ),
        ('{"type": "generate", "request_id": 5, "prompt": "a"}', "bad_request", "request_id"),
        ('{"type": "generate", "request_id": "", "prompt": "a"}', "bad_request", "request_id"),
        ('{"type": "resume"}', "bad_request", "stream_id"),
        ('{"type": "resume", "stream_id": 4}', "bad_request", "stream_id must be a string"),
        ('{"type": "resume", "stream_id": "../../etc"}', "not_found", "no such stream"),
        ('{"type": "cancel"}', "bad_request", "stream_id"),
        ('{"type": "cancel", "stream_id": []}', "bad_request", "stream_id"),
    ],
)
def test_bad_frames(obj: str, code: str, needle: str) -> None:
    err = error_of(obj)
    assert err.code == code
    assert needle in err.message
    frame = err.frame()
    assert frame["type"] == "error" and frame["code"] == code and frame["message"] == err.message


@pytest.mark.parametrize("rid", ["r\r\n1", "\u2603", "r 1", "r\u2028", "r" * 129])
def test_request_ids_that_headers_or_logs_cannot_carry_are_refused(rid: str) -> None:
    err = error_of({"type": "generate", "request_id": rid, "prompt": "a"})
    assert err.code == "bad_request" and err.message.startswith("request_id must be 1 to 128")
    assert "request_id" not in err.frame()  # not echoed


def test_resume_token_length_is_bounded() -> None:
    for kind in ("resume", "cancel"):
        err = error_of({"type": kind, "stream_id": SID, "resume_token": "t" * 100_000})
        assert err.code == "bad_request" and "resume_token must be 1 to 128" in err.message
        assert err.stream_id == SID


def test_errors_carry_the_request_id() -> None:
    err = error_of({"type": "generate", "request_id": "r9", "prompt": "a", "params": {"top_p": 2}})
    assert err.request_id == "r9" and err.frame()["request_id"] == "r9"
    assert "top_p" in err.message


@pytest.mark.parametrize(
    ("obj", "needle"),
    [
        ({"stream_id": SID}, "resume_token"),
        ({"stream_id": SID, "resume_token": 1}, "resume_token must be a string"),
        ({"stream_id": SID, "resume_token": "t", "after": -1}, "after must be >= 0"),
        ({"stream_id": SID, "resume_token": "t", "after": 1.5}, "after must be an integer"),
        ({"stream_id": SID, "resume_token": "t", "after": True}, "after must be an integer"),
        ({"stream_id": SID, "resume_token": "t", "after": "3"}, "after must be an integer"),
    ],
)
def test_bad_resume(obj: dict[str, object], needle: str) -> None:
    err = error_of({"type": "resume", **obj})
    assert err.code == "bad_request" and needle in err.message
    assert err.stream_id == SID


def test_resume_and_cancel() -> None:
    frame = parse({"type": "resume", "stream_id": SID, "resume_token": "tok", "after": 17})
    assert frame == p.Resume(SID, "tok", 17)
    assert parse({"type": "resume", "stream_id": SID, "resume_token": "tok"}) == p.Resume(
        SID, "tok", 0
    )
    assert parse({"type": "cancel", "stream_id": SID}) == p.Cancel(SID, None)
    assert parse({"type": "cancel", "stream_id": SID, "resume_token": "t"}) == p.Cancel(SID, "t")
    err = error_of({"type": "cancel", "stream_id": SID, "resume_token": 3})
    assert err.code == "bad_request"


def test_size_limits() -> None:
    limits = p.Limits(max_input_chars=10, max_messages=2, max_stop=1, max_stop_chars=3)
    assert error_of({"type": "generate", "prompt": "x" * 11}, limits).code == "too_large"
    msgs = [{"role": "user", "content": "12345"}, {"role": "user", "content": "123456"}]
    assert error_of({"type": "generate", "messages": msgs}, limits).code == "too_large"
    msgs3 = [{"role": "user", "content": "a"}] * 3
    assert error_of({"type": "generate", "messages": msgs3}, limits).code == "too_large"
    stop2 = {"type": "generate", "prompt": "a", "params": {"stop": ["a", "b"]}}
    assert error_of(stop2, limits).code == "too_large"
    stop_long = {"type": "generate", "prompt": "a", "params": {"stop": ["abcd"]}}
    assert error_of(stop_long, limits).code == "too_large"
    rid = {"type": "generate", "request_id": "r" * 129, "prompt": "a"}
    assert error_of(rid).code == "bad_request"
    deep = "[" * 100_000 + "]" * 100_000
    assert error_of(deep).code == "bad_request"


def test_server_frames() -> None:
    hello = p.hello_frame(20.0, max_frame_bytes=1024, server="tokenrelay/x")
    assert hello["type"] == "hello" and hello["protocol"] == 1 and hello["heartbeat_s"] == 20.0
    started = p.started_frame("r1", SID, "tok", 42)
    assert started == {
        "type": "started",
        "request_id": "r1",
        "stream_id": SID,
        "resume_token": "tok",
        "prompt_tokens": 42,
    }
    assert p.token_frame(SID, 1, "Hel") == {
        "type": "token",
        "stream_id": SID,
        "seq": 1,
        "text": "Hel",
    }
    done = p.done_frame(SID, 9, "stop", 42, 8)
    assert done["usage"] == {"prompt_tokens": 42, "completion_tokens": 8} and "message" not in done
    assert p.done_frame(SID, 2, "error", 1, 0, "worker died")["message"] == "worker died"
    assert p.resumed_frame(SID, 17) == {"type": "resumed", "stream_id": SID, "after": 17}
    assert p.pong_frame() == {"type": "pong"}
    err = p.error_frame("not_found", "gone", stream_id=SID)
    assert err == {"type": "error", "code": "not_found", "message": "gone", "stream_id": SID}
    assert p.cancelled_frame(SID, "finished", "length")["finish_reason"] == "length"
    assert json.loads(p.encode(p.token_frame(SID, 3, "héllo ✓"))) == p.token_frame(
        SID, 3, "héllo ✓"
    )
    assert "✓" in p.encode({"t": "✓"})  # UTF-8 kept, not escaped
    with pytest.raises(ValueError):
        p.ProtocolError("teapot", "no")


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False)
        | st.text(max_size=20),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
        max_leaves=20,
    )
)
def test_any_json_parses_or_gets_a_typed_error(obj: object) -> None:
    candidates = [
        obj,
        {"type": "generate", "prompt": "x", "params": obj},
        {"type": "generate", "messages": obj},
        {"type": "resume", "stream_id": obj},
    ]
    for candidate in candidates:
        try:
            p.parse_frame(json.dumps(candidate))
        except p.ProtocolError as exc:
            assert exc.code in p.ERROR_CODES and exc.message


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_parses_or_gets_a_typed_error(text: str) -> None:
    try:
        p.parse_frame(text)
    except p.ProtocolError as exc:
        assert exc.code in p.ERROR_CODES


def test_unpaired_surrogates_are_a_bad_request() -> None:
    """Found by tests/gateway/ws/test_fuzz.py: a lone surrogate once reached Redis (internal)."""
    lone = '{"type": "generate", "prompt": "a\\ud8fe", "params": {"max_tokens": 1}}'
    err = error_of(lone)
    assert err.code == "bad_request" and "surrogate" in err.message
    pair = parse({"type": "generate", "prompt": "\U0001f600"})  # escaped as a valid pair
    assert isinstance(pair, p.Generate) and pair.prompt == "\U0001f600"


def test_retry_after_in_error_frames() -> None:
    frame = p.ProtocolError("rate_limited", "slow down", retry_after=0.2).frame()
    assert frame["retry_after"] == 1
    assert "retry_after" not in p.error_frame("bad_request", "x")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40), st.integers(0, 10**9))
def test_encode_token_is_the_generic_encoding(text: str, seq: int) -> None:
    """The per-token fast path writes exactly what encode(token_frame(...)) writes."""
    assert p.encode_token(SID, seq, text) == p.encode(p.token_frame(SID, seq, text))
    assert json.loads(p.encode_token(SID, seq, text))["text"] == text


def test_a_stream_id_with_a_trailing_newline_is_no_stream_id() -> None:
    """``$`` in a pattern matches before a final newline: ids are matched whole."""
    err = error_of({"type": "resume", "stream_id": SID + "\n", "resume_token": "t"})
    assert err.code == "not_found"
