"""The long prompts of bench/vs_llamacpp.py (the RAG case): varied notes sized to about a
target number of tokens by the first server's ``usage.prompt_tokens``, the same text for
both servers, each prompt different from its start (no prefix-cache hits); one request per
length, for its TTFT."""

from __future__ import annotations

import argparse
import asyncio
import random

import httpx

from bench.common import say
from bench.stream_levels import Stream, new_client, one_request, warm_up
from bench.vs_llamacpp_servers import Proc

SUBJECTS = (
    "the north pump",
    "a grain silo",
    "the river gauge",
    "station seven",
    "the old mill",
    "a wind turbine",
    "the ferry dock",
    "the east orchard",
    "a relay tower",
    "the archive",
)
EVENTS = ("logged", "reported", "measured", "recorded", "flagged", "estimated")
THINGS = (
    "pressure readings",
    "crates of apples",
    "litres of water",
    "visitors",
    "kilowatt hours",
    "faulty valves",
    "parcels",
    "rain gauges",
    "lamp hours",
)
NOTES = ("after the storm passed", "before the inspection", "during the night shift",
         "while the road was closed", "on a quiet morning", "despite the power cut")  # fmt: skip


def long_text(sentences: int, seed: int) -> list[dict]:
    """Chat messages: ``sentences`` varied notes (deterministic in ``seed``), then a question.
    Each seed starts differently, so no prompt shares more than the chat template's
    opening with another (no prefix-cache hits between the prompts)."""
    rng = random.Random(seed)
    lines = [f"Notes batch {seed}-{rng.randrange(10**6)}: read them, then answer at the end."]
    for i in range(sentences):
        lines.append(
            f"Record {i + 1}: {rng.choice(SUBJECTS)} {rng.choice(EVENTS)} "
            f"{rng.randrange(2, 9999)} {rng.choice(THINGS)} {rng.choice(NOTES)}, "
            f"at {rng.randrange(24):02d}:{rng.randrange(60):02d} on day {rng.randrange(1, 366)}."
        )
    lines.append("Question: which record has the largest number? Answer in one word.")
    return [{"role": "user", "content": "\n".join(lines)}]


async def calibrate(client: httpx.AsyncClient, url: str) -> tuple[int, float]:
    """The server's prompt tokens for 0 notes and per note (usage.prompt_tokens)."""
    probe = 40
    zero = await one_request(client, url, 1, long_text(0, 999_001))
    some = await one_request(client, url, 1, long_text(probe, 999_002))
    if not zero.prompt_tokens or not some.prompt_tokens:
        raise RuntimeError("the server sent no usage.prompt_tokens: cannot size the long prompts")
    return zero.prompt_tokens, (some.prompt_tokens - zero.prompt_tokens) / probe


async def drive_long(
    proc: Proc, args: argparse.Namespace, prompts: dict[int, list[dict]]
) -> dict[int, Stream]:
    """One request per target length (the same prompts for both servers, made on the first)."""
    out = {}
    async with new_client(args) as client:
        await warm_up(client, proc, args)
        if not prompts:
            base, per = await calibrate(client, proc.url)
            say(f"  long prompts: {base} tokens + {per:.2f} per note ({proc.name}'s tokenizer)")
            for i, n in enumerate(args.long_prompts):
                prompts[n] = long_text(max(1, round((n - base) / per)), 1000 + i)
        for n, messages in prompts.items():
            s = await asyncio.wait_for(
                one_request(client, proc.url, args.long_max_tokens, messages), args.level_timeout
            )
            say(f"  {proc.name}: prompt of ~{n} tokens ({s.prompt_tokens} by usage): "
                f"TTFT {s.ttft * 1000:.0f} ms, {s.tokens} tokens out")  # fmt: skip
            out[n] = s
    return out
