"""Tool calls with the official ``openai`` SDK against a real gateway and model: a
required call parses and validates, streamed as ``delta.tool_calls`` fragments as they
are generated; over the WebSocket as token frames' ``tool_calls``; the tool's answer
goes back in a ``tool`` message."""

from __future__ import annotations

import json
from typing import Any, cast

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from tests.engine.test_tool_calls_engine import CLOCK, SCHEMAS
from tests.engine.test_tool_calls_engine import WEATHER as WEATHER_TOOL
from tests.gateway.http.conftest import ApiStack
from tests.gateway.http.test_sdk import sync_client
from tests.gateway.procs import Client, generate_frame

# the engine test's tools: get_weather(city, unit) and get_time(zone)
TOOLS = cast(list[ChatCompletionToolParam], [WEATHER_TOOL, CLOCK])
WEATHER = SCHEMAS["get_weather"]
ASK: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather in Paris?"}
]


def test_a_required_call_parses_and_validates(api_stack: ApiStack) -> None:
    client = sync_client(api_stack.a)
    out = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, temperature=0,
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and choice.message.content is None
    call = calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    schema = WEATHER if call.function.name == "get_weather" else SCHEMAS["get_time"]
    jsonschema.validate(json.loads(call.function.arguments), schema)

    # the call and the tool's answer go back in the history, and the model answers
    history: list[ChatCompletionMessageParam] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},  # type: ignore[list-item]
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    answer = client.chat.completions.create(
        model="default", messages=history, tools=TOOLS, tool_choice="none", max_tokens=16,
        temperature=0,
    )  # fmt: skip
    assert answer.choices[0].message.content  # (the small model's answer is not judged)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_a_named_call_streams_as_delta_tool_calls(api_stack: ApiStack) -> None:
    client = sync_client(api_stack.a)
    stream = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, max_tokens=120, temperature=0.7, seed=4,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, stream=True,
    )  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    finish, content, pieces = None, "", 0
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        pieces += bool(delta.tool_calls)
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += tc.id or ""
            slot["name"] += (tc.function and tc.function.name) or ""
            slot["arguments"] += (tc.function and tc.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert pieces > 2  # the arguments came as they were generated, not whole at the end
    assert list(calls) == [0] and calls[0]["name"] == "get_time"
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_time"])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]},
         "tools[0].function.parameters"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_param(
    api_stack: ApiStack, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "default", "messages": ASK, "tools": TOOLS, **extra}
    r = httpx.post(f"http://{api_stack.a}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_sdk_sees_the_400(api_stack: ApiStack) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sync_client(api_stack.a).chat.completions.create(
            model="default", messages=ASK, tool_choice="required"
        )
    assert info.value.param == "tool_choice"


async def test_websocket_done_carries_the_calls(api_stack: ApiStack) -> None:
    ws = await Client.open(api_stack.a)
    try:
        frame = generate_frame("What time is it in Lima?", "tc1", max_tokens=120, temperature=0,
                               tools=TOOLS, tool_choice="required")  # fmt: skip
        await ws.send(frame)
        frames = await ws.recv_until(lambda f: f["type"] in ("done", "error"))
    finally:
        await ws.close()
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "tool_calls", done
    tokens = [f for f in frames if f["type"] == "token"]
    assert "".join(f["text"] for f in tokens) == ""  # the call markup is no content
    assert [f["seq"] for f in tokens] == list(range(1, done["seq"]))  # no gap all the same
    assert done["tool_calls"] and all(c["type"] == "function" for c in done["tool_calls"])
    # the token frames carried the calls as they were generated: they add up to done's
    streamed: dict[int, dict[str, str]] = {}
    for d in (d for f in tokens for d in f.get("tool_calls", [])):
        slot = streamed.setdefault(d["index"], {"id": "", "name": "", "arguments": ""})
        slot["id"] += d.get("id", "")
        slot["name"] += d["function"].get("name", "")
        slot["arguments"] += d["function"]["arguments"]
    assert sum("tool_calls" in f for f in tokens) > 2
    assert [streamed[i] for i in sorted(streamed)] == [
        {"id": c["id"], **c["function"]} for c in done["tool_calls"]
    ]
