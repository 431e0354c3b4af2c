"""``n`` > 1 with the official ``openai`` SDK against a real gateway and model: one
stream per choice, the prompt prefilled once, streamed and not, each choice resumable."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.http.conftest import ApiStack
from tests.gateway.http.test_sdk import sync_client
from tests.gateway.procs import Client, generate_frame

# long enough for several full KV blocks that the later choices take from the cache
PROMPT = "Tell me a short story about a lighthouse keeper and a seal. " * 6
MESSAGES = [{"role": "user", "content": PROMPT}]


def hit_tokens(stack: ApiStack) -> int:
    return int(stack.worker_stats().get("prefix_cache_hit_tokens", 0))


def test_n_choices_share_the_prompt_and_differ_by_seed(api_stack: ApiStack) -> None:
    client = sync_client(api_stack.a)
    before = hit_tokens(api_stack)
    raw = client.chat.completions.with_raw_response.create(
        model="default", messages=MESSAGES, n=3, max_tokens=12, temperature=0.9, seed=7,  # type: ignore[arg-type]
    )  # fmt: skip
    out = raw.parse()
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    texts = [c.message.content for c in out.choices]
    assert len(set(texts)) > 1, texts  # seeds 7, 8, 9
    assert out.usage is not None and out.usage.completion_tokens == 36
    sids = raw.headers["X-Stream-Id"].split(",")
    tokens = raw.headers["X-Resume-Token"].split(",")
    assert len(sids) == len(set(sids)) == 3 and len(tokens) == 3
    # the same request again gives the same choices (a seed per choice)
    again = client.chat.completions.create(
        model="default", messages=MESSAGES, n=3, max_tokens=12, temperature=0.9, seed=7,  # type: ignore[arg-type]
    )  # fmt: skip
    assert [c.message.content for c in again.choices] == texts
    # choices 1 and 2 took the prompt's full blocks from the cache (fork, not prefill)
    prompt_tokens = out.usage.prompt_tokens
    deadline = time.monotonic() + 10
    while hit_tokens(api_stack) - before < 2 * (prompt_tokens - 16) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hit_tokens(api_stack) - before >= 2 * (prompt_tokens - 16)

    # a resume of choice 1 renders its own index
    r = httpx.get(f"http://{api_stack.a}/v1/streams/{sids[1]}/events",
                  params={"resume_token": tokens[1]}, timeout=30)  # fmt: skip
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    assert chunks and all(c["choices"][0]["index"] == 1 for c in chunks if c["choices"])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == texts[1]


def test_n_choices_stream_interleaved_with_one_done(api_stack: ApiStack) -> None:
    client = sync_client(api_stack.a)
    stream = client.completions.create(
        model="default", prompt="The three best things about autumn are", n=2, max_tokens=10,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    texts = ["", ""]
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert finish == {0: "length", 1: "length"}
    assert texts[0] == texts[1] != ""  # greedy: the same choice twice
    assert usage is not None and usage.completion_tokens == 20
    one = client.completions.create(
        model="default", prompt="The three best things about autumn are", max_tokens=10,
        temperature=0,
    )  # fmt: skip
    assert one.choices[0].text == texts[0]


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_a_400(api_stack: ApiStack, n: int) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sync_client(api_stack.a).chat.completions.create(
            model="default",
            messages=MESSAGES,
            n=n,  # type: ignore[arg-type]
        )
    assert info.value.param == "n"


async def test_websocket_n_starts_one_stream_per_choice(api_stack: ApiStack) -> None:
    ws = await Client.open(api_stack.a)
    try:
        await ws.send(generate_frame("Name a color.", "n2", max_tokens=6, temperature=0.8,
                                     seed=3, n=2))  # fmt: skip
        frames: list[dict[str, Any]] = []
        dones: list[dict[str, Any]] = []
        while len(dones) < 2:
            frame = await ws.recv()
            frames.append(frame)
            assert frame["type"] != "error", frame
            if frame["type"] == "done":
                dones.append(frame)
        await ws.send(generate_frame("Hi", "n0", n=0))
        refused = await ws.recv()
    finally:
        await ws.close()
    started = [f for f in frames if f["type"] == "started"]
    assert sorted(f["index"] for f in started) == [0, 1]
    assert len({f["stream_id"] for f in started}) == 2
    assert all(f["request_id"] == "n2" for f in started)
    for f in started:
        text = "".join(t["text"] for t in frames
                       if t["type"] == "token" and t["stream_id"] == f["stream_id"])  # fmt: skip
        assert text, f
    assert refused["type"] == "error" and refused["code"] == "bad_request", refused
