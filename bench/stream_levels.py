"""The client of bench/vs_llamacpp.py, the same for both servers: streamed chat requests
(httpx, async, SSE) timed as their chunks arrive (TTFT, the gaps between content chunks),
levels of concurrent clients each sending requests one after another, the percentiles, and
the warm-up request with the memory a server holds after it."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from bench.common import say
from bench.vs_llamacpp_servers import Memory, Proc, gib, process_names, process_tree

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a comet."}]


@dataclass
class Stream:
    """Client-side timings of one request (seconds, perf_counter)."""

    start: float
    chunks: list[float] = field(default_factory=list)  # arrival of each content chunk
    tokens: int = 0  # completion tokens (usage, else content chunks)
    prompt_tokens: int = 0  # from usage, 0 if the server sent none

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.start

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


@dataclass
class Level:
    concurrency: int
    streams: list[Stream]
    wall: float

    def summary(self) -> dict[str, float]:
        ttft = [s.ttft for s in self.streams]
        itl = [g for s in self.streams for g in s.itl]
        tokens = sum(s.tokens for s in self.streams)
        return {
            "requests": float(len(self.streams)),
            "tokens": float(tokens),
            "min_tokens": float(min(s.tokens for s in self.streams)),
            "max_tokens": float(max(s.tokens for s in self.streams)),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "tok_s": tokens / self.wall,
        }  # fmt: skip


@dataclass
class Run:
    """One server's results: the levels, its memory, the long prompts (target -> stream)."""

    levels: dict[int, Level] = field(default_factory=dict)
    memory: Memory | None = None
    long: dict[int, Stream] = field(default_factory=dict)
    config: str = ""


def pct(values: list[float], p: float) -> float:
    """The p-th percentile in milliseconds (nearest rank), NaN if empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))] * 1000


def body(max_tokens: int, messages: list[dict] | None = None) -> dict:
    # ignore_eos: both servers generate exactly max_tokens (llama-server and tokenrelay
    # both take it as an extension of the OpenAI body)
    return {"model": "default", "messages": messages or PROMPT, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


async def one_request(
    client: httpx.AsyncClient, url: str, max_tokens: int, messages: list[dict] | None = None
) -> Stream:
    s = Stream(time.perf_counter())
    usage = None
    buf = b""
    payload = body(max_tokens, messages)
    async with client.stream("POST", url + "/v1/chat/completions", json=payload) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for chunk in resp.aiter_bytes():
            now = time.perf_counter()
            buf += chunk.replace(b"\r\n", b"\n")
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = b"\n".join(
                    line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")
                )
                if not data:
                    continue  # a comment (keep-alive)
                if data == b"[DONE]":
                    s.tokens = usage if usage is not None else len(s.chunks)
                    if not s.chunks:
                        raise RuntimeError("the stream carried no content")
                    return s
                obj = json.loads(data)
                if obj.get("usage"):
                    usage = obj["usage"].get("completion_tokens")
                    s.prompt_tokens = int(obj["usage"].get("prompt_tokens") or 0)
                if any(c.get("delta", {}).get("content") for c in obj.get("choices") or []):
                    s.chunks.append(now)
    raise RuntimeError("the stream ended without [DONE]")


async def level(
    client: httpx.AsyncClient, url: str, c: int, per_client: int, max_tokens: int
) -> Level:
    """``c`` clients at once, each sending ``per_client`` requests one after another."""

    async def client_loop() -> list[Stream]:
        return [await one_request(client, url, max_tokens) for _ in range(per_client)]

    t0 = time.perf_counter()
    results = await asyncio.gather(*(client_loop() for _ in range(c)))
    return Level(c, [s for r in results for s in r], time.perf_counter() - t0)


def new_client(args: argparse.Namespace) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


async def warm_up(client: httpx.AsyncClient, proc: Proc, args: argparse.Namespace) -> Memory:
    warm = await one_request(client, proc.url, min(16, args.max_tokens))
    pids = process_tree(proc.proc.pid)
    now = proc.memory.sample()
    memory = Memory(now, load_peak=proc.memory.peak, processes=len(pids), names=process_names(pids))
    proc.memory.peak = now  # from here on: the peak while serving
    say(f"  {proc.name}: warm-up done ({warm.tokens} tokens); RSS {gib(memory.after_warmup)} "
        f"over {memory.processes} process(es): {memory.names}")  # fmt: skip
    return memory


async def drive(proc: Proc, args: argparse.Namespace) -> tuple[dict[int, Level], Memory]:
    out = {}
    async with new_client(args) as client:
        memory = await warm_up(client, proc, args)
        for c in args.streams:
            lvl = await asyncio.wait_for(
                level(client, proc.url, c, args.requests_per_client, args.max_tokens),
                args.level_timeout,
            )
            s = lvl.summary()
            say(f"  {proc.name}: {c:>3} streams, {len(lvl.streams)} requests, {lvl.wall:6.1f} s, "
                f"{s['tok_s']:.1f} tok/s, ITL p50 {s['itl_p50']:.1f} ms, "
                f"RSS peak {gib(proc.memory.peak)}")  # fmt: skip
            out[c] = lvl
    proc.memory.sample()
    memory.peak = proc.memory.peak
    return out, memory
