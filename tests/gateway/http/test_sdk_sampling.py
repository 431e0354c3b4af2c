"""The official ``openai`` SDK against real gateways and the real model: penalties, logit
bias, logprobs (against transformers on the same weights), unsupported fields."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam

from tests.engine.conftest import hf_model, model_path
from tests.gateway.http.conftest import ApiStack
from tests.gateway.http.test_sdk import sync_client
from tests.gateway.procs import Client, generate_frame
from tokenrelay.engine.text.token_text import TokenTexts

__all__ = ["hf_model", "model_path"]  # the engine suite's fixtures

MSGS: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three colours."}]
PROMPT = "1, 2, 1, 2, 1, 2, 1, 2,"


@pytest.fixture(scope="module")
def tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.fixture(scope="module")
def ids_of_bytes(tokenizer: Any) -> dict[bytes, int]:
    """A token's exact bytes -> its id (the ordinary vocabulary, not the added tokens)."""
    texts = TokenTexts(tokenizer)
    return {texts(i)[1]: i for i in range(len(tokenizer)) if i not in texts._added}


# the served worker keeps its KV cache in float16 (transformers' reference: float32), which
# moves logprobs by a few thousandths
LOGPROB_TOL = 1e-2


def reference(hf_model: Any, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.inference_mode():
        logits = hf_model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)


def chat_prompt_ids(tokenizer: Any) -> list[int]:
    text = tokenizer.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_chat_logprobs_match_transformers(
    api_stack: ApiStack, hf_model: Any, tokenizer: Any, ids_of_bytes: dict[bytes, int]
) -> None:
    client = sync_client(api_stack.a)
    full = client.chat.completions.create(
        model="default", messages=MSGS, max_tokens=10, temperature=0, logprobs=True,
        top_logprobs=5,
    )  # fmt: skip
    choice = full.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    assert "".join(c.token for c in content) == choice.message.content
    ids = [ids_of_bytes[bytes(c.bytes or [])] for c in content]
    ref = reference(hf_model, chat_prompt_ids(tokenizer), ids)
    for pos, (tok, c) in enumerate(zip(ids, content, strict=True)):
        assert c.logprob == pytest.approx(ref[pos, tok].item(), abs=LOGPROB_TOL)
        tops = [t.logprob for t in c.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert c.top_logprobs[0].token == c.token  # greedy: the chosen one is the most likely
        assert tops == pytest.approx(ref[pos].topk(5).values.tolist(), abs=LOGPROB_TOL)

    stream = client.chat.completions.create(
        model="default", messages=MSGS, max_tokens=10, temperature=0, logprobs=True,
        top_logprobs=5, stream=True,
    )  # fmt: skip
    streamed = [
        c
        for chunk in stream
        for ch in chunk.choices
        if ch.logprobs
        for c in ch.logprobs.content or []
    ]
    assert [(c.token, c.bytes) for c in streamed] == [(c.token, c.bytes) for c in content]
    # (the prefix cache may serve the second prompt: the same values to float rounding)
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)


def test_completion_logprobs_shape(api_stack: ApiStack) -> None:
    client = sync_client(api_stack.b)
    out = client.completions.create(
        model="default", prompt="The capital of France is", max_tokens=6, temperature=0,
        logprobs=3,
    ).choices[0]  # fmt: skip
    lp = out.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert "".join(lp.tokens) == out.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[tok] == value == max(top.values())  # greedy, and the chosen one is there
        assert 3 <= len(top) <= 4
    streamed: list[str] = []
    for chunk in client.completions.create(
        model="default", prompt="The capital of France is", max_tokens=6, temperature=0,
        logprobs=3, stream=True,
    ):  # fmt: skip
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.tokens or []
    assert streamed == lp.tokens


def token_ids(client: openai.OpenAI, ids_of_bytes: dict[bytes, int], **kw: Any) -> list[int]:
    out = client.chat.completions.create(
        model="default", messages=MSGS, temperature=0, logprobs=True, **kw
    )
    content = out.choices[0].logprobs.content or []  # type: ignore[union-attr]
    return [ids_of_bytes[bytes(c.bytes or [])] for c in content]


def test_logit_bias_bans_and_forces(api_stack: ApiStack, ids_of_bytes: dict[bytes, int]) -> None:
    client = sync_client(api_stack.a)
    first = token_ids(client, ids_of_bytes, max_tokens=1)[0]
    banned = token_ids(client, ids_of_bytes, max_tokens=1, logit_bias={str(first): -100})
    assert banned[0] != first
    forced = ids_of_bytes[b" blue"]
    got = token_ids(client, ids_of_bytes, max_tokens=3, logit_bias={str(forced): 100})
    assert got == [forced] * 3


def test_penalties_change_the_output(api_stack: ApiStack) -> None:
    client = sync_client(api_stack.b)

    def text(**kw: Any) -> str:
        kw.setdefault("temperature", 0)
        out = client.completions.create(model="default", prompt=PROMPT, max_tokens=24, **kw)
        return out.choices[0].text

    plain = text()
    assert plain.count("1,") + plain.count("2,") >= 8  # the model loops on its own
    for penalised in (
        text(frequency_penalty=2.0),
        text(extra_body={"repetition_penalty": 2.0}),
        text(presence_penalty=2.0, frequency_penalty=1.0),
    ):
        assert penalised != plain
        assert penalised.count("1,") + penalised.count("2,") < plain.count("1,") + plain.count("2,")
    seeded = [text(temperature=1.0, seed=9, frequency_penalty=0.5, extra_body={"min_p": 0.1})]
    seeded.append(text(temperature=1.0, seed=9, frequency_penalty=0.5, extra_body={"min_p": 0.1}))
    assert seeded[0] == seeded[1]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("tool_choice", "required"),  # with no tools
        ("web_search_options", {}),
        ("functions", [{"name": "f"}]),
        ("reasoning_effort", "low"),
        ("service_tier", "flex"),
    ],
)
def test_unsupported_fields_are_400s_naming_the_param(
    api_stack: ApiStack, field: str, value: Any
) -> None:
    client = sync_client(api_stack.a)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=MSGS, **{field: value})
    assert info.value.param == field
    assert info.value.type == "invalid_request_error"


def test_unknown_and_out_of_range_fields_are_400s(api_stack: ApiStack) -> None:
    client = sync_client(api_stack.a)
    cases = [
        ({"extra_body": {"not_a_field": 1}}, "not_a_field"),
        ({"logit_bias": {"49152": 5}}, "logit_bias"),  # past the vocabulary
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="default", messages=MSGS, max_tokens=2, **kw)
        assert info.value.param == param
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="default", prompt="x", logprobs=6)
    assert info.value.param == "logprobs"


async def test_websocket_token_frames_carry_logprobs(api_stack: ApiStack) -> None:
    ws = await Client.open(api_stack.a)
    try:
        await ws.send(generate_frame("Hi", "lp1", max_tokens=6, temperature=0, logprobs=2))
        frames = await ws.recv_until(lambda f: f["type"] in ("done", "error"))
    finally:
        await ws.close()
    tokens = [f for f in frames if f["type"] == "token"]
    assert tokens and frames[-1]["type"] == "done"
    for f in tokens:
        assert "".join(e["token"] for e in f["logprobs"]) == f["text"]
        for e in f["logprobs"]:
            assert len(e["top_logprobs"]) == 2 and e["logprob"] <= 0
            assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
