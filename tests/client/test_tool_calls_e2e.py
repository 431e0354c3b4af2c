"""Streamed tool calls through the Python client against the suite's real stack (the
default model; a named ``tool_choice`` makes the call certain): the token events' deltas
add up to the ``done`` frame's calls, ``s.tool_calls`` shows each call as it is written,
and sockets cut mid-call by a TCP proxy (tests/client/proxy.py) neither drop nor double
a fragment."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest

from tests.client.proxy import CutProxy
from tests.gateway.procs import Client as RawClient
from tests.gateway.procs import generate_frame
from tests.gateway.stack import Stack
from tokenrelay.client import AsyncClient, Client, FinishReason, RetryPolicy, Token

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
QUESTION = "What is the weather in Paris?"
MESSAGES = [{"role": "user", "content": QUESTION}]
PARAMS: dict[str, Any] = {
    "max_tokens": 120,
    "temperature": 0,
    "tools": [WEATHER],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
}
FAST = RetryPolicy(initial=0.05, maximum=0.5)


def add_up(events: Iterable[Token]) -> list[dict[str, Any]]:
    """The calls the deltas of ``events`` make, in index order (OpenAI's shape)."""
    calls: dict[int, dict[str, Any]] = {}
    for d in (d for t in events for d in t.tool_calls):
        if d.id is not None:
            assert d.index not in calls, "a call's first entry came twice"
            calls[d.index] = {"id": d.id, "type": "function",
                              "function": {"name": d.name, "arguments": ""}}  # fmt: skip
        calls[d.index]["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


@pytest.fixture(scope="module")
def reference(stack: Stack) -> dict[str, Any]:
    """The frames of the named call, streamed once on a raw socket that never drops."""

    async def run() -> list[dict[str, Any]]:
        c = await RawClient.open(stack.a)
        try:
            await c.send(generate_frame(QUESTION, "tools-ref", **PARAMS))
            return list(await c.recv_until(lambda f: f["type"] in ("done", "error"), 120))
        finally:
            await c.close()

    frames = asyncio.run(run())
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "tool_calls", done
    assert done["tool_calls"][0]["function"]["name"] == "get_weather"
    deltas = [d for f in frames if f["type"] == "token" for d in f.get("tool_calls", [])]
    assert len(deltas) > 2, "the arguments came in fragments"
    return {"calls": done["tool_calls"], "deltas": deltas}


def wire(events: Iterable[Token]) -> list[dict[str, Any]]:
    """The deltas of ``events`` back in the frame's shape, to compare with the raw socket's."""
    out: list[dict[str, Any]] = []
    for d in (d for t in events for d in t.tool_calls):
        fn: dict[str, Any] = {"arguments": d.arguments}
        entry: dict[str, Any] = {"index": d.index, "function": fn}
        if d.id is not None:
            entry.update(id=d.id, type="function")
            fn["name"] = d.name
        out.append(entry)
    return out


def same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Equal but for the calls' ids (each stream has its own), which must look alike."""
    assert all(x["id"].startswith("call_") for x in a + b if "id" in x)
    return [{**x, "id": "call_"} if "id" in x else x for x in a] == [
        {**x, "id": "call_"} if "id" in x else x for x in b
    ]


@pytest.fixture
async def proxy(stack: Stack) -> AsyncIterator[CutProxy]:
    p = CutProxy(stack.a)
    await p.start()
    try:
        yield p
    finally:
        await p.close()


async def test_the_calls_stream_as_deltas_and_done_has_them_whole(
    stack: Stack, reference: dict[str, Any]
) -> None:
    seen: list[list[dict[str, Any]]] = []  # s.tool_calls after each event, as it streamed
    async with AsyncClient(f"http://{stack.a}") as c:
        s = await c.chat(MESSAGES, **PARAMS)
        events = []
        async for event in s.events():
            events.append(event)
            if not s.finished:
                seen.append(json.loads(json.dumps(s.tool_calls)))
    assert s.finish_reason == FinishReason.TOOL_CALLS and s.text == ""
    assert [e.seq for e in events] == list(range(1, s.last_seq))
    assert same(wire(events), reference["deltas"])
    assert add_up(events) == s.tool_calls and same(s.tool_calls, reference["calls"])
    # while streaming, each call showed its id, name and arguments as far as they came
    final = reference["calls"][0]["function"]["arguments"]
    partial = [c[0]["function"]["arguments"] for c in seen if c]
    assert partial and all(final.startswith(p) for p in partial)
    assert any(p != final for p in partial), "a call was seen before it was whole"
    assert all(c[0]["id"] == s.tool_calls[0]["id"] for c in seen if c)


async def test_sockets_cut_mid_call_neither_drop_nor_double_a_fragment(
    stack: Stack, reference: dict[str, Any], proxy: CutProxy
) -> None:
    async with AsyncClient(f"http://{proxy.addr}", retry=FAST) as c:
        s = await c.chat(MESSAGES, **PARAMS)
        events = []
        async for event in s.events():
            events.append(event)
            if len(events) in (2, 5, 9) and not s.finished:
                assert proxy.cut() >= 1  # the socket, reset with no close frame
    assert s.resumes >= 1 and c.connects >= 2
    assert s.duplicates == 0 and s.gaps == 0
    assert [e.seq for e in events] == list(range(1, s.last_seq))
    assert same(wire(events), reference["deltas"])
    assert add_up(events) == s.tool_calls and same(s.tool_calls, reference["calls"])
    assert s.finish_reason == FinishReason.TOOL_CALLS


def test_the_blocking_client_and_a_resume_mid_call(stack: Stack, reference: dict[str, Any]) -> None:
    with Client(f"http://{stack.a}") as c:
        s = c.chat(MESSAGES, **PARAMS)
        events = list(s.events())
        assert same(wire(events), reference["deltas"]) and add_up(events) == s.tool_calls
        assert same(s.tool_calls, reference["calls"])
        assert s.stream_id and s.resume_token
        # a resume from the middle of the call, holding the calls as they were there
        mid = next(i for i, e in enumerate(events) if e.tool_calls and not e.tool_calls[0].id)
        held = add_up(events[: mid + 1])
        r = c.resume(s.stream_id, s.resume_token, after=events[mid].seq, tool_calls=held)
        rest = list(r.events())
        assert rest and rest[0].seq == events[mid].seq + 1
        assert add_up(events[: mid + 1] + rest) == s.tool_calls == r.tool_calls
