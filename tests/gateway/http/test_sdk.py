"""The official ``openai`` SDK against real gateways, a real worker and the default model."""

from __future__ import annotations

import asyncio

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.gateway.http.conftest import ApiStack

PROMPT = "Name three colours."
MAX = 16


def sync_client(addr: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0, timeout=120)


def async_client(addr: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://{addr}/v1", api_key="unused", max_retries=0, timeout=120
    )


def test_models(api_stack: ApiStack) -> None:
    client = sync_client(api_stack.a)
    models = client.models.list()
    assert [m.id for m in models.data] == ["default"]
    assert models.data[0].object == "model" and models.data[0].owned_by == "tokenrelay"
    assert client.models.retrieve("default").id == "default"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_sync_chat_stream_equals_non_stream(api_stack: ApiStack) -> None:
    client = sync_client(api_stack.a)
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]
    full = client.chat.completions.create(
        model="default", messages=msgs, max_tokens=MAX, temperature=0
    )
    assert full.object == "chat.completion" and full.model == "default"
    assert full.id.startswith("chatcmpl-")
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert full.usage is not None and full.usage.prompt_tokens > 0
    assert 0 < full.usage.completion_tokens <= MAX
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    stream = client.chat.completions.create(
        model="default",
        messages=msgs,
        max_tokens=MAX,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert text == choice.message.content
    assert finish == [choice.finish_reason]
    assert usage_chunk.usage.model_dump() == full.usage.model_dump()


async def test_async_completions_stream_equals_non_stream(api_stack: ApiStack) -> None:
    client = async_client(api_stack.b)
    try:
        full = await client.completions.create(
            model="default", prompt="The capital of France is", max_tokens=MAX, temperature=0
        )
        assert full.object == "text_completion" and full.id.startswith("cmpl-")
        assert full.choices[0].text and full.usage is not None
        stream = await client.completions.create(
            model="default",
            prompt="The capital of France is",
            max_tokens=MAX,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full.choices[0].text
        assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons[-1] == full.choices[0].finish_reason
    finally:
        await client.close()


async def test_async_chat_concurrent_streams(api_stack: ApiStack) -> None:
    client = async_client(api_stack.a)

    async def one(i: int) -> str:
        stream = await client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": f"Count to {i + 2}."}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    try:
        texts = await asyncio.gather(*(one(i) for i in range(4)))
        assert all(texts)
    finally:
        await client.close()


def test_sdk_errors(api_stack: ApiStack) -> None:
    client = sync_client(api_stack.a)
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=msgs)
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model="default", messages=msgs, n=17)
    assert br.value.param == "n"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default", prompt="x", temperature=7)


def test_sampling_with_seed_is_reproducible(api_stack: ApiStack) -> None:
    client = sync_client(api_stack.a)
    texts = [
        client.completions.create(
            model="default", prompt="Once upon a time", max_tokens=8, seed=1234,
            temperature=1.0, top_p=0.9,
        ).choices[0].text
        for _ in range(2)
    ]  # fmt: skip
    assert texts[0] == texts[1]


def test_stop_strings(api_stack: ApiStack) -> None:
    client = sync_client(api_stack.a)
    base = client.completions.create(
        model="default", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0
    )
    text = base.choices[0].text
    assert len(text) > 3
    stop = text[2:4]
    cut = client.completions.create(
        model="default", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text and text.startswith(cut.choices[0].text)


def test_prompt_as_token_ids(api_stack: ApiStack) -> None:
    client = sync_client(api_stack.b)
    text = client.completions.create(
        model="default", prompt="The sky is", max_tokens=4, temperature=0
    )
    ids = client.completions.create(
        model="default", prompt=[504, 6376, 314], max_tokens=4, temperature=0
    )  # "The sky is" in SmolLM2's tokenizer
    assert ids.usage is not None and ids.usage.prompt_tokens == 3
    assert ids.choices[0].text == text.choices[0].text
