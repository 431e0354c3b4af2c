"""gateway/http/openai_request.py: request validation and error bodies (no server)."""

from __future__ import annotations

from typing import Any

import pytest

from tokenrelay.gateway.http.openai_request import (
    ApiError,
    error_for_code,
    parse_chat,
    parse_completion,
    parse_json,
)
from tokenrelay.gateway.session.protocol import Limits

LIMITS = Limits()
MSG = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any) -> Any:
    return parse_chat({"messages": MSG, **fields}, served_model="default", limits=LIMITS)


def completion(**fields: Any) -> Any:
    return parse_completion({"prompt": "Hi", **fields}, served_model="default", limits=LIMITS)


def test_minimal_chat_defaults() -> None:
    req = chat()
    assert req.kind == "chat" and req.model == "default"
    assert req.stream is False and req.include_usage is False
    assert req.body["messages"] == MSG
    params = req.body["params"]
    assert params["max_tokens"] == LIMITS.max_tokens
    assert params["temperature"] == 1.0 and params["top_p"] == 1.0 and params["stop"] == []


def test_all_supported_fields() -> None:
    req = chat(
        model="default",
        max_tokens=7,
        temperature=0,
        top_p=0.5,
        n=1,
        stop="END",
        seed=42,
        stream=True,
        stream_options={"include_usage": True},
        user="u-1",
        top_k=5,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=0,
        repetition_penalty=1.1,
        min_p=0.05,
        logit_bias={"17": -100, "3": 2.5},
        stop_token_ids=[2],
        logprobs=True,
        top_logprobs=4,
        tool_choice="none",  # asks for nothing this server lacks
        store=False,  # accepted hints
        metadata={"k": "v"},
    )
    assert req.stream and req.include_usage and req.user == "u-1" and req.logprobs
    p = req.body["params"]
    assert p == {
        "max_tokens": 7,
        "temperature": 0.0,
        "top_p": 0.5,
        "top_k": 5,
        "seed": 42,
        "stop": ["END"],
        "ignore_eos": True,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.1,
        "logit_bias": {17: -100.0, 3: 2.5},
        "stop_token_ids": [2],
        "logprobs": 4,
        "response_format": None,
        "tools": None,
        "tool_choice": None,
        "parallel_tool_calls": True,
    }


def test_max_completion_tokens_wins() -> None:
    assert chat(max_tokens=5, max_completion_tokens=9).body["params"]["max_tokens"] == 9


def test_top_p_zero_means_greedy() -> None:
    assert chat(top_p=0).body["params"]["temperature"] == 0.0


def test_message_forms() -> None:
    msgs = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "name": "bot"},
        {"role": "user", "content": "c"},
    ]
    req = parse_chat({"messages": msgs}, served_model="default", limits=LIMITS)
    assert req.body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "c"},
    ]


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("Hi", "Hi"), (["Hi"], "Hi"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5])],
)
def test_completion_prompt_forms(prompt: Any, expected: Any) -> None:
    req = parse_completion({"prompt": prompt}, served_model="default", limits=LIMITS)
    assert req.kind == "completion" and req.body["prompt"] == expected


BAD_CHAT: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("missing messages", {"messages": None}, 400, "messages"),
    ("messages not a list", {"messages": "hi"}, 400, "messages"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("message not object", {"messages": ["hi"]}, 400, "messages"),
    ("bad role", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (
        "tool role without call id",
        {"messages": [{"role": "tool", "content": "x"}]},
        400,
        "messages[0].tool_call_id",
    ),
    ("content int", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    (
        "image part",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content",
    ),
    ("unknown model", {"model": "gpt-4o"}, 404, "model"),
    ("model not str", {"model": 3}, 400, "model"),
    ("n = 17", {"n": 17}, 400, "n"),
    ("n = 0", {"n": 0}, 400, "n"),
    ("n = 0", {"n": 0}, 400, "n"),
    ("n str", {"n": "1"}, 400, "n"),
    ("max_tokens str", {"max_tokens": "10"}, 400, "max_tokens"),
    ("max_tokens float", {"max_tokens": 1.5}, 400, "max_tokens"),
    ("max_tokens bool", {"max_tokens": True}, 400, "max_tokens"),
    ("max_tokens 0", {"max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens huge", {"max_tokens": 10**9}, 400, "max_tokens"),
    ("mct negative", {"max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("temperature str", {"temperature": "hot"}, 400, "temperature"),
    ("temperature > 2", {"temperature": 2.5}, 400, "temperature"),
    ("temperature < 0", {"temperature": -0.1}, 400, "temperature"),
    ("top_p > 1", {"top_p": 1.5}, 400, "top_p"),
    ("top_k < -1", {"top_k": -2}, 400, "top_k"),
    ("seed str", {"seed": "42"}, 400, "seed"),
    ("seed negative", {"seed": -1}, 400, "seed"),
    ("seed huge", {"seed": 2**64}, 400, "seed"),
    ("stop int", {"stop": 5}, 400, "stop"),
    ("stop list of int", {"stop": [1]}, 400, "stop"),
    ("stop empty string", {"stop": [""]}, 400, "stop"),
    ("too many stops", {"stop": ["x"] * 17}, 413, "stop"),  # as on the WebSocket
    ("stream str", {"stream": "yes"}, 400, "stream"),
    ("stream_options list", {"stream": True, "stream_options": []}, 400, "stream_options"),
    (
        "include_usage str",
        {"stream": True, "stream_options": {"include_usage": "yes"}},
        400,
        "stream_options",
    ),
    ("user int", {"user": 7}, 400, "user"),
    ("logprobs int", {"logprobs": 3}, 400, "logprobs"),
    ("top_logprobs without logprobs", {"top_logprobs": 3}, 400, "top_logprobs"),
    ("top_logprobs > 20", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("penalty range", {"presence_penalty": 3}, 400, "presence_penalty"),
    ("frequency_penalty < -2", {"frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("repetition_penalty 0", {"repetition_penalty": 0}, 400, "repetition_penalty"),
    ("min_p > 1", {"min_p": 1.5}, 400, "min_p"),
    ("logit_bias list", {"logit_bias": [1]}, 400, "logit_bias"),
    ("logit_bias key", {"logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("logit_bias range", {"logit_bias": {"1": 101}}, 400, "logit_bias"),
    ("logit_bias size", {"logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),
    ("stop_token_ids str", {"stop_token_ids": "2"}, 400, "stop_token_ids"),
    ("stop_token_ids neg", {"stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("stop_token_ids many", {"stop_token_ids": list(range(65))}, 413, "stop_token_ids"),
    ("ignore_eos str", {"ignore_eos": "no"}, 400, "ignore_eos"),
    ("too many messages", {"messages": MSG * 300}, 413, "messages"),
    ("too much input", {"messages": [{"role": "user", "content": "x" * 200_001}]}, 413, None),
]


@pytest.mark.parametrize(
    ("case", "fields", "status", "param"), BAD_CHAT, ids=[c[0] for c in BAD_CHAT]
)
def test_bad_chat_requests(
    case: str, fields: dict[str, Any], status: int, param: str | None
) -> None:
    body = {"messages": MSG, **fields}
    if body["messages"] is None:
        del body["messages"]
    with pytest.raises(ApiError) as info:
        parse_chat(body, served_model="default", limits=LIMITS)
    err = info.value
    assert err.status == status
    assert err.param == param
    out = err.body()["error"]
    assert set(out) == {"message", "type", "param", "code"}
    assert isinstance(out["message"], str) and out["message"]
    assert out["type"] == "invalid_request_error"


BAD_COMPLETION: list[tuple[str, dict[str, Any], int]] = [
    ("missing prompt", {"prompt": None}, 400),
    ("empty prompt", {"prompt": ""}, 400),
    ("prompt int", {"prompt": 5}, 400),
    ("two prompts", {"prompt": ["a", "b"]}, 400),
    ("bad token ids", {"prompt": [1, -2]}, 400),
    ("bool token ids", {"prompt": [True]}, 400),
    ("mixed list", {"prompt": [1, "a"]}, 400),
    ("echo", {"echo": True}, 400),
    ("suffix", {"suffix": "tail"}, 400),
    ("best_of", {"best_of": 3}, 400),
    ("logprobs > 5", {"logprobs": 6}, 400),
    ("logprobs bool", {"logprobs": True}, 400),
    ("top_logprobs", {"top_logprobs": 2}, 400),  # a chat field
    ("tools", {"tools": []}, 400),  # not a completions field at all
    ("too long", {"prompt": "x" * 200_001}, 413),
]


@pytest.mark.parametrize(
    ("case", "fields", "status"), BAD_COMPLETION, ids=[c[0] for c in BAD_COMPLETION]
)
def test_bad_completion_requests(case: str, fields: dict[str, Any], status: int) -> None:
    body = {"prompt": "Hi", **fields}
    if body["prompt"] is None:
        del body["prompt"]
    with pytest.raises(ApiError) as info:
        parse_completion(body, served_model="default", limits=LIMITS)
    assert info.value.status == status


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"[1,2]", b'"x"', b"null", b'{"a": NaN}', b"\xff\xfe", b'{"a": "\\ud800"}'],
)
def test_parse_json_rejects(raw: bytes) -> None:
    with pytest.raises(ApiError) as info:
        parse_json(raw)
    assert info.value.status == 400


def test_parse_json_keeps_surrogate_pairs() -> None:
    assert parse_json(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}


def test_error_for_code_statuses_and_retry_after() -> None:
    table = {
        "bad_request": (400, "invalid_request_error"),
        "unauthorized": (401, "authentication_error"),
        "forbidden": (403, "permission_error"),
        "not_found": (404, "invalid_request_error"),
        "too_large": (413, "invalid_request_error"),
        "rate_limited": (429, "rate_limit_error"),
        "overloaded": (503, "server_error"),
        "unavailable": (503, "server_error"),
        "internal": (500, "server_error"),
        "something_new": (500, "server_error"),
    }
    for code, (status, kind) in table.items():
        err = error_for_code(code, "m")
        assert (err.status, err.type) == (status, kind), code
        assert ("Retry-After" in err.headers()) == (status in (429, 503)), code
    assert error_for_code("unavailable", "m", retry_after=2.2).headers() == {"Retry-After": "3"}
