"""Structured outputs with the official ``openai`` SDK against a real gateway and model:
20 schema-constrained answers all validate; a bad schema is a 400 naming the param."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.gateway.http.conftest import ApiStack
from tests.gateway.http.test_sdk import async_client, sync_client
from tests.gateway.procs import Client, generate_frame

# small bounded fields, so the small model finishes each answer well within max_tokens
ITEM = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "genre": {"type": "string", "enum": ["drama", "comedy", "horror", "sci-fi"]},
        "seen": {"type": "boolean"},
    },
    "required": ["title", "rating", "genre", "seen"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "review", "schema": ITEM, "strict": True}}
TOPICS = ["a space film", "a ghost story", "a family drama", "a silly comedy", "an old western"]


async def test_twenty_schema_constrained_answers_all_validate(api_stack: ApiStack) -> None:
    client = async_client(api_stack.a)

    async def ask(i: int) -> str | None:
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": f"Review {TOPICS[i % len(TOPICS)]} as JSON."}
        ]
        greedy = i < len(TOPICS)
        out = await client.chat.completions.create(
            model="default", messages=messages, max_tokens=100,
            temperature=0 if greedy else 0.8, seed=None if greedy else i,
            response_format=FORMAT,  # type: ignore[arg-type]
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        return choice.message.content

    answers = await asyncio.gather(*(ask(i) for i in range(20)))  # one batch
    for text in answers:
        jsonschema.validate(json.loads(text or ""), ITEM)


def test_completions_take_response_format_and_stream(api_stack: ApiStack) -> None:
    client = sync_client(api_stack.a)
    stream = client.completions.create(
        model="default", prompt="A movie review in JSON:", max_tokens=100, temperature=0,
        stream=True, extra_body={"response_format": FORMAT},
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in stream if c.choices)
    jsonschema.validate(json.loads(text), ITEM)


def test_bad_schema_is_a_400_naming_the_param(api_stack: ApiStack) -> None:
    client = sync_client(api_stack.a)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Hi"}],
            response_format=bad,  # type: ignore[arg-type]
        )  # fmt: skip
    assert str(info.value.param).startswith("response_format")
    assert info.value.type == "invalid_request_error"


async def test_websocket_params_response_format(api_stack: ApiStack) -> None:
    ws = await Client.open(api_stack.a)
    try:
        frame = generate_frame("Review a film as JSON.", "rf1", max_tokens=100, temperature=0)
        await ws.send({**frame, "params": {**frame["params"], "response_format": FORMAT}})
        frames = await ws.recv_until(lambda f: f["type"] in ("done", "error"))
        bad = {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}
        frame = generate_frame("Hi", "rf2", response_format=bad)
        await ws.send(frame)
        refused = await ws.recv_until(lambda f: f["type"] in ("done", "error"))
    finally:
        await ws.close()
    assert frames[-1]["type"] == "done", frames[-1]
    text = "".join(f["text"] for f in frames if f["type"] == "token")
    jsonschema.validate(json.loads(text), ITEM)
    assert refused[-1]["type"] == "error", refused[-1]
    assert refused[-1]["code"] == "bad_request", refused[-1]
    assert refused[-1]["message"].startswith("response_format.json_schema.schema"), refused[-1]
