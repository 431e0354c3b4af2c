"""core/wire/tools.py and core/wire/structured.py: tools, tool_choice, parsing calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenrelay.core.wire.errors import RequestError, ResponseFormatError, ToolError
from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.requests import Limits, validate_messages, validate_params
from tokenrelay.core.wire.tools import (
    OPEN,
    ToolChoice,
    call_grammar,
    decode_calls,
    encode_calls,
    parse_tool_calls,
    parse_tool_choice,
    parse_tools,
    render_call,
)

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_tools_parse_and_keep_their_schema() -> None:
    weather, clock = parse_tools([WEATHER, TIME])
    assert weather.name == "get_weather" and weather.description == "Weather of a city"
    assert json.loads(weather.parameters)["required"] == ["city"]
    assert json.loads(clock.parameters) == {"type": "object", "properties": {}}
    assert weather.to_dict() == WEATHER
    assert parse_tools(None) == ()


@pytest.mark.parametrize(
    ("tools", "field"),
    [
        ("get_weather", "tools"),
        ([{"type": "retrieval"}], "tools[0]"),
        ([{"type": "function", "function": {"name": "bad name"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "extra": 1}}], "tools[0].function.extra"),
        ([TIME, TIME], "tools[1].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tools_name_the_field(tools: Any, field: str) -> None:
    with pytest.raises(ResponseFormatError) as info:
        parse_tools(tools)
    assert info.value.field == field


def test_tool_choice_values() -> None:
    tools = parse_tools([WEATHER, TIME])
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, ()) == ToolChoice("none")
    assert parse_tool_choice("required", tools).constrained
    named = parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, tools)
    assert named == ToolChoice("function", "get_time") and named.constrained
    assert named.to_value() == {"type": "function", "function": {"name": "get_time"}}
    with pytest.raises(ToolError, match="no tool named"):
        parse_tool_choice({"type": "function", "function": {"name": "nope"}}, tools)
    with pytest.raises(ToolError, match="needs at least one tool"):
        parse_tool_choice("required", ())
    with pytest.raises(ToolError):
        parse_tool_choice("sometimes", tools)


def test_calls_parse_from_text_with_stable_ids() -> None:
    tools = parse_tools([WEATHER, TIME])
    text = "Let me check.\n" + render_call("get_weather", {"city": "Paris"}) + "\n"
    text += render_call("get_time", "{}")
    content, calls = parse_tool_calls(text, tools, "s1")
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    again = parse_tool_calls(text, tools, "s1")[1]
    assert [c.id for c in again] == [c.id for c in calls] and calls[0].id != calls[1].id
    assert parse_tool_calls(text, tools, "s2")[1][0].id != calls[0].id
    assert decode_calls(encode_calls(calls)) == calls


@pytest.mark.parametrize(
    "text",
    [
        "no tags at all",
        f"{OPEN}\nnot json\n</tool_call>",
        f'{OPEN}\n{{"name": "launch_rockets", "arguments": {{}}}}\n</tool_call>',  # not offered
        f'{OPEN}\n{{"name": "get_time", "arguments": [1]}}\n</tool_call>',
    ],
)
def test_text_that_makes_no_call_is_all_content(text: str) -> None:
    assert parse_tool_calls(text, parse_tools([WEATHER, TIME]), "s") == (text, ())


def test_required_grammar_compiles_and_accepts_a_call() -> None:
    llguidance = pytest.importorskip("llguidance")
    tools = parse_tools([WEATHER, TIME])
    for choice, parallel in [
        (ToolChoice("required"), True),
        (ToolChoice("function", "get_time"), True),
    ]:
        grammar = llguidance.LLMatcher.grammar_from_lark(call_grammar(tools, choice, parallel))
        assert llguidance.LLMatcher.validate_grammar(grammar, None) == ""
    with pytest.raises(ValueError):
        call_grammar(tools, ToolChoice("auto"), True)


def test_sampling_params_carry_tools_and_their_grammar() -> None:
    p = SamplingParams(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert p.guided is not None and p.guided.type == "tool_calls"
    assert "call+" not in (p.guided.schema or "") and [t.name for t in p.offered_tools] == [
        "get_weather"
    ]
    auto = SamplingParams(tools=[WEATHER])
    assert auto.guided is None and auto.tool_choice == "auto" and auto.offered_tools
    assert SamplingParams(tools=[WEATHER], tool_choice="none").offered_tools == ()
    with pytest.raises(ValueError, match="response_format"):
        SamplingParams(
            tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}
        )


def test_validate_params_refuses_bad_tool_fields_by_name() -> None:
    limits = Limits()
    with pytest.raises(RequestError) as info:
        validate_params({"tools": [WEATHER], "tool_choice": "sometimes"}, limits)
    assert info.value.field == "tool_choice"
    with pytest.raises(RequestError) as info:
        validate_params({"tools": [WEATHER], "response_format": {"type": "json_object"}}, limits)
    assert info.value.field == "response_format"
    with pytest.raises(RequestError) as info:
        validate_params({"tools": [WEATHER], "parallel_tool_calls": "yes"}, limits)
    assert info.value.field == "parallel_tool_calls"
    ok = validate_params({"tools": [WEATHER], "tool_choice": "none"}, limits)
    assert ok.tools == [WEATHER] and ok.offered_tools == ()


def test_messages_take_tool_calls_and_tool_results() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    msgs = validate_messages(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        Limits(),
    )
    assert msgs[1].tools == {"tool_calls": [call]} and msgs[1].content == ""
    assert msgs[2].tools == {"tool_call_id": "call_1"}
    bad: list[tuple[dict[str, Any], str]] = [
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": [call]}, "messages[0].tool_calls"),
        ({"role": "assistant", "content": "", "tool_calls": [{**call, "function": {
            "name": "f", "arguments": "{nope"}}]}, "messages[0].tool_calls[0].function.arguments"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[0].tool_call_id"),
    ]  # fmt: skip
    for msg, field in bad:
        with pytest.raises(RequestError) as info:
            validate_messages([msg], Limits())
        assert info.value.field == field
