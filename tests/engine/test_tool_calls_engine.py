"""Tool calls through the real engine: the prompt shows the tools, and a required or
named tool call is constrained to calls whose arguments validate against the tool."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from tests.engine.test_guided_engine import run
from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.tools import parse_tool_calls
from tokenrelay.core.wire.vocabulary import ToolFormat
from tokenrelay.engine.text.chat import plain_messages

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 16}},
            "required": ["zone"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


def test_the_prompt_shows_the_tools_and_the_tool_turns(llm_engine: Any) -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    history: list[dict[str, Any]] = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
    ]
    params = SamplingParams(tools=[WEATHER, CLOCK])
    text = llm_engine.tokenizer.decode(
        llm_engine.apply_chat_template(history, params.offered_tools)
    )
    assert "<tools>" in text and '"name": "get_weather"' in text and "get_time" in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert text.rstrip().endswith("<|im_start|>assistant")
    plain = plain_messages(history, ())
    assert [m["role"] for m in plain] == ["user", "assistant", "user"]  # no tools shown


def test_required_and_named_calls_validate(llm_engine: Any) -> None:
    tools = [WEATHER, CLOCK]
    cases = {
        "required": SamplingParams(
            max_tokens=120, temperature=0.0, tools=tools, tool_choice="required"
        ),
        "single": SamplingParams(
            max_tokens=120,
            temperature=0.8,
            seed=3,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
        ),
        "named": SamplingParams(
            max_tokens=120,
            temperature=0.7,
            seed=5,
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        ),
    }
    requests = {
        rid: (llm_engine.apply_chat_template(ASK, p.offered_tools), p) for rid, p in cases.items()
    }
    results = run(llm_engine, requests)
    for rid, (_, text, reason) in results.items():
        assert reason == "stop", (rid, text)
        content, calls = parse_tool_calls(text, cases[rid].offered_tools, rid)
        assert content == "" and calls, (rid, text)
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        if rid != "required":
            assert len(calls) == 1
        if rid == "named":
            assert calls[0].name == "get_time"


@pytest.mark.parametrize("fmt", [ToolFormat.LLAMA3, ToolFormat.MISTRAL, ToolFormat.GRANITE])
def test_a_named_call_is_written_in_the_models_own_format(llm_engine: Any, fmt: ToolFormat) -> None:
    """An engine whose model writes calls another way (its chat template says which)
    constrains a named call to that format, and the reader gets it back from the text."""
    named = {"type": "function", "function": {"name": "get_time"}}
    params = SamplingParams(max_tokens=120, temperature=0.0, tools=[WEATHER, CLOCK],
                            tool_choice=named)  # fmt: skip
    was = llm_engine.tool_format
    llm_engine.tool_format = fmt
    try:
        prompt = llm_engine.apply_chat_template(ASK, params.offered_tools)
        [(_, text, reason)] = run(llm_engine, {"f": (prompt, params)}).values()
    finally:
        llm_engine.tool_format = was
    assert reason == "stop", text
    assert "<tool_call>" not in text and text.lstrip()[:1] in ("{", "[", "<")
    content, calls = parse_tool_calls(text, params.offered_tools, "f", fmt)
    assert content == "" and [c.name for c in calls] == ["get_time"], text
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["get_time"])
