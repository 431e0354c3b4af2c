"""core/wire/requests.py: one validator, the same refusals on the WebSocket and HTTP."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from tokenrelay.core.wire.errors import RequestError
from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.requests import (
    CHARS_PER_TOKEN,
    DEFAULT_MAX_TOKENS_LIMIT,
    MAX_RESUME_TOKEN,
    MAX_SEED,
    Limits,
    Message,
    check_input_size,
    is_request_id,
    validate_messages,
    validate_params,
    validate_request_id,
    validate_resume_token,
)
from tokenrelay.gateway.http.openai_request import (
    ApiError,
    parse_chat,
    parse_completion,
    request_id_header,
)
from tokenrelay.gateway.session import protocol as p

LIMITS = Limits()
SMALL = Limits(max_input_chars=10, max_messages=2, max_stop=2, max_stop_chars=3, max_tokens=50)


def refusal(raw: dict[str, Any], limits: Limits = LIMITS) -> RequestError:
    with pytest.raises(RequestError) as info:
        validate_params(raw, limits)
    return info.value


def ws_error(params: dict[str, Any], limits: Limits = LIMITS) -> p.ProtocolError:
    frame = {"type": "generate", "request_id": "r1", "prompt": "Hi", "params": params}
    with pytest.raises(p.ProtocolError) as info:
        p.parse_frame(json.dumps(frame), limits)
    return info.value


def http_error(fields: dict[str, Any], limits: Limits = LIMITS, chat: bool = True) -> ApiError:
    with pytest.raises(ApiError) as info:
        if chat:
            body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
            parse_chat(body, served_model="m", limits=limits)
        else:
            parse_completion({"prompt": "Hi", **fields}, served_model="m", limits=limits)
    return info.value


def test_defaults_defined_once() -> None:
    assert DEFAULT_MAX_TOKENS_LIMIT == 8192 and MAX_SEED == 2**63
    assert LIMITS.max_tokens == DEFAULT_MAX_TOKENS_LIMIT
    assert p.Limits is Limits and p.Message is Message


def test_valid_params() -> None:
    params = validate_params(
        {"max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": -1, "seed": 3, "stop": "END"},
        LIMITS,
    )
    assert params == SamplingParams(7, 0.0, 0.5, 0, 3, ["END"], False)
    assert validate_params({}, LIMITS) == SamplingParams()
    assert validate_params({"seed": None}, LIMITS).seed is None
    assert validate_params({"max_tokens": 50, "stop": ["abc", "d"]}, SMALL).max_tokens == 50


BAD: list[tuple[dict[str, Any], str, str, str]] = [
    ({"max_token": 5}, "bad_request", "max_token", "unknown param 'max_token'"),
    ({"max_tokens": "9"}, "bad_request", "max_tokens", "max_tokens must be an integer, got str"),
    (
        {"max_tokens": True},
        "bad_request",
        "max_tokens",
        "max_tokens must be an integer, got a boolean",
    ),
    (
        {"max_tokens": 0},
        "bad_request",
        "max_tokens",
        "max_tokens must be between 1 and 8192, got 0",
    ),
    (
        {"max_tokens": 8193},
        "bad_request",
        "max_tokens",
        "max_tokens must be between 1 and 8192, got 8193",
    ),
    (
        {"temperature": "hot"},
        "bad_request",
        "temperature",
        "temperature must be a number, got str",
    ),
    (
        {"temperature": -0.1},
        "bad_request",
        "temperature",
        "temperature must be between 0 and 2, got -0.1",
    ),
    (
        {"temperature": 2.5},
        "bad_request",
        "temperature",
        "temperature must be between 0 and 2, got 2.5",
    ),
    ({"top_p": 1.5}, "bad_request", "top_p", "top_p must be in (0, 1], got 1.5"),
    ({"top_k": 1.5}, "bad_request", "top_k", "top_k must be an integer, got float"),
    ({"top_k": -2}, "bad_request", "top_k", "top_k must be >= -1 (0 or -1 disables it), got -2"),
    ({"seed": -1}, "bad_request", "seed", "seed must be in [0, 2**63)"),
    ({"seed": 2**63}, "bad_request", "seed", "seed must be in [0, 2**63)"),
    ({"seed": "1"}, "bad_request", "seed", "seed must be an integer, got str"),
    ({"stop": 5}, "bad_request", "stop", "stop must be a string or a list of strings"),
    ({"stop": [1]}, "bad_request", "stop", "stop must be a string or a list of strings"),
    ({"stop": [""]}, "bad_request", "stop", "stop strings must not be empty"),
    ({"stop": ""}, "bad_request", "stop", "stop strings must not be empty"),
    ({"stop": ["x"] * 17}, "too_large", "stop", "stop may hold at most 16 strings"),
    ({"stop": "x" * 201}, "too_large", "stop", "stop strings are limited to 200 characters"),
    ({"stop": ["x" * 201]}, "too_large", "stop", "stop strings are limited to 200 characters"),
    ({"ignore_eos": 1}, "bad_request", "ignore_eos", "ignore_eos must be a boolean, got int"),
]


@pytest.mark.parametrize(("raw", "code", "field", "message"), BAD, ids=[b[3] for b in BAD])
def test_bad_params_same_on_every_transport(
    raw: dict[str, Any], code: str, field: str, message: str
) -> None:
    err = refusal(raw)
    assert (err.code, err.field, err.message) == (code, field, message)
    ws = ws_error(raw)
    assert (ws.code, ws.message, ws.request_id) == (code, message, "r1")
    if field == "max_token":
        return  # HTTP ignores fields it does not know
    for chat in (True, False):
        api = http_error(raw, chat=chat)
        assert api.body()["error"] == {
            "message": message,
            "type": "invalid_request_error",
            "param": field,
            "code": code,
        }
        assert api.status == (413 if code == "too_large" else 400)


def test_a_single_stop_string_counts_against_the_limits() -> None:
    for stop in ("abcd", ["abcd"]):
        assert refusal({"stop": stop}, SMALL).code == "too_large"
        assert ws_error({"stop": stop}, SMALL).code == "too_large"
        assert http_error({"stop": stop}, SMALL).status == 413


def test_temperature_is_capped_on_both_transports() -> None:
    assert ws_error({"temperature": 5}).code == "bad_request"
    assert http_error({"temperature": 5}).status == 400
    assert validate_params({"temperature": 2}, LIMITS).temperature == 2.0


def test_max_tokens_cap_follows_the_limits() -> None:
    err = ws_error({"max_tokens": 51}, SMALL)
    assert err.message == "max_tokens must be between 1 and 50, got 51"
    api = http_error({"max_completion_tokens": 51}, SMALL)
    assert api.param == "max_completion_tokens"
    assert api.message == "max_completion_tokens must be between 1 and 50, got 51"


def test_http_shapes_map_onto_the_validator() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "top_p": 0, "seed": None}
    params = parse_chat(body, served_model="m", limits=LIMITS).body["params"]
    assert params["temperature"] == 0.0 and params["top_p"] == 1.0 and params["seed"] is None
    assert params["max_tokens"] == LIMITS.max_tokens  # HTTP default: the cap
    assert ws_error({"top_p": 0}).message == "top_p must be in (0, 1], got 0"


def test_messages() -> None:
    raw = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    assert validate_messages(raw, LIMITS) == (Message("system", "Be brief"), Message("user", "Hi"))
    roles = {"developer": "system", "user": "user"}
    dev = validate_messages([{"role": "developer", "content": "x"}], LIMITS, roles=roles)
    assert dev == (Message("system", "x"),)


BAD_MESSAGES: list[tuple[Any, str, str | None, str]] = [
    ("hi", "bad_request", "messages", "messages must be a list"),
    ([], "bad_request", "messages", "messages must not be empty"),
    ([{"role": "user", "content": "a"}] * 3, "too_large", "messages", "at most 2 messages"),
    ([5], "bad_request", "messages", "messages[0] must be an object"),
    (
        [{"role": "god", "content": "x"}],
        "bad_request",
        "messages[0].role",
        "messages[0].role must be one of system, user, assistant, tool",
    ),
    (
        [{"role": "user", "content": 1}],
        "bad_request",
        "messages[0].content",
        "messages[0].content must be a string or a list of content parts",
    ),
    (
        [{"role": "user", "content": "123456"}, {"role": "user", "content": "12345"}],
        "too_large",
        None,
        "input is 11 characters; the limit is 10",
    ),
]


@pytest.mark.parametrize(
    ("raw", "code", "field", "message"), BAD_MESSAGES, ids=[b[3] for b in BAD_MESSAGES]
)
def test_bad_messages_same_on_every_transport(
    raw: Any, code: str, field: str | None, message: str
) -> None:
    with pytest.raises(RequestError) as info:
        validate_messages(raw, SMALL)
    assert (info.value.code, info.value.field, info.value.message) == (code, field, message)
    with pytest.raises(p.ProtocolError) as ws:
        p.parse_frame(json.dumps({"type": "generate", "messages": raw}), SMALL)
    assert (ws.value.code, ws.value.message) == (code, message)
    with pytest.raises(ApiError) as api:
        parse_chat({"messages": raw}, served_model="m", limits=SMALL)
    assert (api.value.code, api.value.param) == (code, field)
    if field is None or not field.startswith("messages["):  # HTTP takes more roles and shapes
        assert api.value.message == message


def test_input_size() -> None:
    check_input_size(10, SMALL)
    with pytest.raises(RequestError) as info:
        check_input_size(11, SMALL)
    assert info.value.code == "too_large" and info.value.field is None
    assert ws_error({}, Limits(max_input_chars=1)).code == "too_large"
    assert http_error({}, Limits(max_input_chars=1), chat=False).status == 413


def test_input_size_follows_the_models_context() -> None:
    assert LIMITS.for_context(None) is LIMITS
    small = LIMITS.for_context(1000)
    assert small.max_input_chars == 1000 * CHARS_PER_TOKEN and small.context_tokens == 1000
    assert small.max_tokens == LIMITS.max_tokens  # nothing else changes
    check_input_size(1000 * CHARS_PER_TOKEN, small)
    with pytest.raises(RequestError) as info:
        check_input_size(1000 * CHARS_PER_TOKEN + 1, small)
    assert info.value.code == "too_large"
    assert "per token of the model's 1000-token context" in info.value.message
    huge = LIMITS.for_context(10**6)  # never above the configured limit
    assert huge.max_input_chars == LIMITS.max_input_chars


# --- ids (issue 19: ids a client chooses end up in headers and log lines) -------------

UNSAFE_IDS = [
    "r\r\nX-Evil: 1",
    "r\n1",
    "caf\u00e9",
    "\u2603",
    "a b",
    "r\x1b[2J",
    "a/b",
    "",
    "r" * 129,
]


@pytest.mark.parametrize("rid", UNSAFE_IDS, ids=repr)
def test_unsafe_request_ids_are_refused_on_every_transport(rid: str) -> None:
    with pytest.raises(RequestError) as info:
        validate_request_id(rid, LIMITS)
    assert (info.value.code, info.value.field) == ("bad_request", "request_id")
    assert "request_id must be 1 to 128 characters of A-Z" in info.value.message
    assert not is_request_id(rid)
    frame = {"type": "generate", "request_id": rid, "prompt": "Hi"}
    with pytest.raises(p.ProtocolError) as ws:
        p.parse_frame(json.dumps(frame), LIMITS)
    assert ws.value.code == "bad_request" and "request_id" in ws.value.message
    assert ws.value.request_id is None  # a refused id is not echoed back
    if rid:  # an empty X-Request-Id header counts as none
        with pytest.raises(ApiError) as api:
            request_id_header(rid, LIMITS)
        assert (api.value.status, api.value.param) == (400, "X-Request-Id")
        assert api.value.code == "bad_request"


def test_safe_request_ids() -> None:
    for rid in ("r1", "req-0f3a.b_c:9", "A" * 128, "550e8400-e29b-41d4-a716-446655440000"):
        assert validate_request_id(rid, LIMITS) == rid and is_request_id(rid)
        assert request_id_header(rid, LIMITS) == rid
    assert validate_request_id(None, LIMITS) is None
    assert request_id_header(None, LIMITS) is None and request_id_header("", LIMITS) is None
    with pytest.raises(RequestError, match="request_id must be a string, got int"):
        validate_request_id(5, LIMITS)
    short = Limits(max_request_id=4)
    with pytest.raises(RequestError, match="1 to 4 characters"):
        validate_request_id("abcde", short)


def test_resume_tokens_are_bounded() -> None:
    token = "aZ09_-" * 7
    assert validate_resume_token(token) == token
    assert validate_resume_token("t" * MAX_RESUME_TOKEN) == "t" * MAX_RESUME_TOKEN
    for bad in ("t" * (MAX_RESUME_TOKEN + 1), "x" * 1_000_000, "", "a b", "t\n", "t\u00e9", 5):
        with pytest.raises(RequestError) as info:
            validate_resume_token(bad)
        assert (info.value.code, info.value.field) == ("bad_request", "resume_token")
        sid = "A" * 22
        for kind in ("resume", "cancel"):
            frame = {"type": kind, "stream_id": sid, "resume_token": bad}
            with pytest.raises(p.ProtocolError) as ws:
                p.parse_frame(json.dumps(frame), LIMITS)
            assert ws.value.code == "bad_request" and ws.value.stream_id == sid
            assert "resume_token" in ws.value.message


def test_a_megabyte_stop_string_is_refused_on_both_transports() -> None:
    stop = "x" * 1_000_000  # issue 19: one string must not skip the list limits
    assert refusal({"stop": stop}).code == "too_large"
    assert ws_error({"stop": stop}).code == "too_large"
    assert http_error({"stop": stop}).status == 413
    assert http_error({"stop": stop}, chat=False).status == 413
    for temperature in (2.0001, 1e9):
        assert ws_error({"temperature": temperature}).code == "bad_request"
        assert http_error({"temperature": temperature}, chat=False).status == 400


def test_the_answer_size_is_budgeted_up_front() -> None:
    """n x max_tokens x (1 + top_logprobs) over --max-output-entries: a 413 naming both,
    before anything is queued; one choice at the defaults always fits."""
    assert validate_params({"max_tokens": 8192, "logprobs": 20}, LIMITS).max_tokens == 8192
    big = {"n": 16, "max_tokens": 8192, "logprobs": True, "top_logprobs": 20}
    api = http_error(big)
    assert api.status == 413 and api.body()["error"]["code"] == "too_large"
    assert api.body()["error"]["message"] == (
        "this request could return 2752512 token entries (n 16 x max_tokens 8192 x (1 + "
        "top_logprobs 20)); the limit is 200000 (--max-output-entries): lower max_tokens, n "
        "or top_logprobs"
    )
    completion = http_error({"n": 5, "max_tokens": 8192, "logprobs": 5}, chat=False)
    assert (
        completion.status == 413
        and "n 5 x max_tokens 8192" in completion.body()["error"]["message"]
    )
    tight = dataclasses.replace(LIMITS, max_output_entries=1000)
    assert (
        ws_error({"max_tokens": 1001}, tight).code == "too_large"
    )  # one choice, over a small budget
    ok = {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 8192}
    assert parse_chat(ok, served_model="m", limits=LIMITS).n == 2  # 16384 entries
