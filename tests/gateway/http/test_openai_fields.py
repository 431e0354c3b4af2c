"""gateway/http/openai_fields.py: no request field is silently ignored (no server)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest

from tests.root import ROOT
from tokenrelay.gateway.http import openai_fields as f
from tokenrelay.gateway.http.openai_request import ApiError, parse_chat, parse_completion
from tokenrelay.gateway.session.protocol import Limits

LIMITS = Limits()
MSG = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any) -> Any:
    return parse_chat({"messages": MSG, **fields}, served_model="default", limits=LIMITS)


def completion(**fields: Any) -> Any:
    return parse_completion({"prompt": "Hi", **fields}, served_model="default", limits=LIMITS)


def refusal(call: Any, **fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        call(**fields)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error"
    return err


UNSUPPORTED_CHAT: list[tuple[str, Any]] = [
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}),
    ("reasoning_effort", "low"),
    ("verbosity", "low"),
    ("moderation", {"model": "omni"}),
    ("prompt_cache_options", {"mode": "explicit"}),
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("service_tier", "flex"),
    ("some_future_field", 1),
    ("guided_json", {}),  # a vLLM extension this server does not have
]


@pytest.mark.parametrize(("name", "value"), UNSUPPORTED_CHAT)
def test_unsupported_chat_fields_are_400s_naming_the_param(name: str, value: Any) -> None:
    err = refusal(chat, **{name: value})
    assert err.param == name and name in err.message


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("audio", None),
        ("modalities", ["text"]),
        ("response_format", {"type": "text"}),
        ("tool_choice", "none"),
        ("function_call", "none"),
        ("tools", None),
        ("user", "u"),
        ("store", True),
        ("metadata", {"a": "b"}),
        ("safety_identifier", "s"),
        ("prompt_cache_key", "k"),
        ("prompt_cache_retention", "24h"),
        ("service_tier", "auto"),
        ("service_tier", "default"),
        ("logprobs", False),
        ("stream_options", {"include_usage": False, "include_obfuscation": True}),
    ],
)
def test_values_that_ask_for_nothing_missing_are_accepted(name: str, value: Any) -> None:
    chat(**{name: value})


@pytest.mark.parametrize(
    ("name", "value"),
    [("store", "yes"), ("metadata", {"a": 1}), ("metadata", {str(i): "v" for i in range(17)})],
)
def test_accepted_hints_are_type_checked(name: str, value: Any) -> None:
    assert refusal(chat, **{name: value}).param == name


@pytest.mark.parametrize(
    ("name", "value"),
    [("tools", []), ("top_logprobs", 1), ("store", False)],
)
def test_chat_only_fields_are_unknown_to_completions(name: str, value: Any) -> None:
    assert refusal(completion, **{name: value}).param == name


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "x"},
         "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),  # auto needs tools
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": 1},
         "parallel_tool_calls"),
    ],
)  # fmt: skip
def test_tool_fields_are_checked(fields: dict[str, Any], param: str) -> None:
    assert refusal(chat, **fields).param == param


def test_unknown_stream_option() -> None:
    err = refusal(chat, stream=True, stream_options={"include_usage": True, "x": 1})
    assert err.param == "stream_options"


def test_chat_logprobs_mapping() -> None:
    assert chat().body["params"]["logprobs"] is None and not chat().logprobs
    assert chat(logprobs=True).body["params"]["logprobs"] == 0
    req = chat(logprobs=True, top_logprobs=20)
    assert req.logprobs and req.body["params"]["logprobs"] == 20
    assert chat(logprobs=False, top_logprobs=0).body["params"]["logprobs"] is None


def test_completion_logprobs_mapping() -> None:
    assert completion().body["params"]["logprobs"] is None
    req = completion(logprobs=0)
    assert req.logprobs and req.body["params"]["logprobs"] == 0
    assert completion(logprobs=5).body["params"]["logprobs"] == 5


def test_token_ids_bounded_by_the_served_vocabulary() -> None:
    limits = dataclasses.replace(LIMITS, vocab_size=100)
    body = {"messages": MSG, "logit_bias": {"99": 1}, "stop_token_ids": [99]}
    parse_chat(body, served_model="default", limits=limits)
    for field, value in (("logit_bias", {"100": 1}), ("stop_token_ids", [100])):
        with pytest.raises(ApiError) as info:
            parse_chat({"messages": MSG, field: value}, served_model="default", limits=limits)
        assert info.value.param == field and "vocabulary" in info.value.message


def _sdk_fields(module: str) -> set[str]:
    import importlib

    params = importlib.import_module(f"openai.types.{module}")
    cls = params.CompletionCreateParamsBase
    return set(typing.get_type_hints(cls, include_extras=False))


def test_every_openai_sdk_field_is_classified() -> None:
    """Each field of the installed openai SDK's request types is supported, accepted or refused
    (so a new SDK field shows up here rather than as 'unrecognized')."""
    known = f.CHAT_SUPPORTED | set(f.ACCEPTED) | set(f.REFUSED)
    assert _sdk_fields("chat.completion_create_params") - known == set()
    legacy = f.COMPLETION_SUPPORTED | f.COMPLETION_ACCEPTED
    assert _sdk_fields("completion_create_params") - legacy == set()


def test_docs_list_every_field() -> None:
    text = Path(ROOT / "docs" / "api.md").read_text()
    names = f.CHAT_SUPPORTED | f.COMPLETION_SUPPORTED | set(f.ACCEPTED) | set(f.REFUSED)
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert missing == []


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("parse", [chat, completion])
@pytest.mark.parametrize(
    "value",
    [
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}},
    ],
)
def test_response_format_is_supported_on_both_endpoints(parse: Any, value: Any) -> None:
    parse(response_format=value)


@pytest.mark.parametrize("parse", [chat, completion])
@pytest.mark.parametrize(
    ("value", "param"),
    [
        ({"type": "regex"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"schema": {"not": {}}}}, "response_format"),
        ({"type": "json_schema"}, "response_format.json_schema"),
    ],
)
def test_bad_response_format_is_a_400_naming_the_param(parse: Any, value: Any, param: str) -> None:
    err = refusal(parse, response_format=value)
    assert err.status == 400 and err.param is not None and err.param.startswith(param)
