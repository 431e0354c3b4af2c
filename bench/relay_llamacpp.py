"""The relay in front of llama.cpp's ``llama-server``: its latency, and what it passes on.

``python -m bench.relay --upstream llamacpp`` (bench/relay.py) starts ``llama-server``
(found or built as for bench/vs_llamacpp.py: bench/llamacpp_build.py) on the default
model's GGUF file, with ``--jinja`` (its tool calls) and ``--alias default``, and a
``tokenrelay gateway`` + ``tokenrelay worker --upstream`` in front of it over an embedded
redis-server. For each level of N concurrent streams, N streaming chat requests (greedy,
``--tokens`` tokens each, ``ignore_eos``, the prompt of bench/stream_levels.py) go to
llama-server directly, then the same N to the relay, timed by bench/stream_levels.py's
client: time to first token and the gaps between content chunks as they arrive (p50,
p99). Then the features, one request each way, direct and relayed (not streamed, greedy):

* ``text``: the answer's text, the same both ways;
* ``logprobs``: ``logprobs: true`` with 2 alternatives, the same tokens both ways;
* ``tools``: ``tool_choice: "required"`` with one tool: the finish reason and the calls;
* ``image``: an ``https`` image part: the status and message each way (a llama-server
  without a multimodal projector refuses images).

    .venv/bin/python -m bench.relay --upstream llamacpp --levels 1,4 --tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench.common import load_average, machine, say
from bench.llamacpp_build import get_llama_server
from bench.relay import PREFIX, free_port, start, wait_http
from bench.stream_levels import PROMPT, level, new_client
from bench.vs_llamacpp import default_gguf
from bench.vs_llamacpp_servers import PEER, ServerConfig, running, start_peer
from tokenrelay.core.redis.embedded import EmbeddedRedis

SECTION = "## Relay in front of llama-server"
SLOTS = 8  # llama-server -np
SLOT_CONTEXT = 1024  # tokens of llama-server's context per slot
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
IMAGE = "https://example.com/lighthouse.png"
FEATURES: dict[str, dict[str, Any]] = {
    "text": {"messages": PROMPT, "max_tokens": 16},
    "logprobs": {"messages": PROMPT, "max_tokens": 8, "logprobs": True, "top_logprobs": 2},
    "tools": {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
              "max_tokens": 64, "tools": [TOOL], "tool_choice": "required"},
    "image": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": IMAGE}}]}], "max_tokens": 8},
}  # fmt: skip


def add_options(p: argparse.ArgumentParser) -> None:
    """bench/relay.py's options for this run (bench/vs_llamacpp.py's names)."""
    p.add_argument("--llama-server", default=None,
                   help="llama-server binary (default: $LLAMA_SERVER, else the cached build, "
                   "else build it: bench/llamacpp_build.py)")  # fmt: skip
    p.add_argument("--build-jobs", type=int, default=2, help="compile jobs if it must be built")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="llama-server -t (default: the cores this process may use)")  # fmt: skip
    p.add_argument("--ready-timeout", type=float, default=300, help="seconds to start")
    p.add_argument("--request-timeout", type=float, default=300, help="seconds a request")
    p.set_defaults(rebuild=False)


def outcome(name: str, resp: httpx.Response) -> dict[str, Any]:
    """What one feature's answer shows, comparable between the two paths."""
    if resp.status_code != 200:
        try:
            said = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            said = resp.text
        return {"status": resp.status_code, "message": str(said)[:160]}
    choice = resp.json()["choices"][0]
    msg = choice.get("message") or {}
    out: dict[str, Any] = {"status": 200, "finish_reason": choice.get("finish_reason")}
    if name == "logprobs":
        out["tokens"] = [e["token"] for e in (choice.get("logprobs") or {}).get("content", [])]
    elif name == "tools":
        out["calls"] = [(c["function"]["name"], c["function"]["arguments"])
                        for c in msg.get("tool_calls") or []]  # fmt: skip
        out["content"] = msg.get("content")
    else:
        out["text"] = msg.get("content")
    return out


async def features(client: httpx.AsyncClient, direct: str, relay: str) -> dict[str, Any]:
    out = {}
    for name, body in FEATURES.items():
        got = []
        for base in (direct, relay):
            payload = {"model": "default", "temperature": 0, **body}
            resp = await client.post(f"{base}/v1/chat/completions", json=payload)
            got.append(outcome(name, resp))
        out[name] = {"direct": got[0], "relay": got[1], "same": got[0] == got[1]}
        say(f"  {name}: {'same' if got[0] == got[1] else 'differs'}: {got[0]} / {got[1]}")
    return out


async def measure(args: argparse.Namespace, direct: str, relay: str) -> dict[str, Any]:
    levels = [int(n) for n in args.levels.split(",")]
    rows = []
    async with new_client(args) as client:
        for base in (direct, relay):  # warm: connections, the relay's model list
            await level(client, base, 1, 1, 4)
        for n in levels:
            for path, base in (("direct", direct), ("relay", relay)):
                lvl = await level(client, base, n, 1, args.tokens)
                rows.append({"path": path, "streams": n, **lvl.summary()})
                say(f"  {path} x{n}: TTFT p50 {rows[-1]['ttft_p50']:.1f} ms, "
                    f"ITL p50 {rows[-1]['itl_p50']:.1f} ms")  # fmt: skip
        checks = await features(client, direct, relay)
    return {"levels": rows, "features": checks}


def run_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    """Start llama-server and the relay in front of it, measure, stop them."""
    binary = get_llama_server(args)
    gguf = default_gguf()
    config = ServerConfig(SLOTS, SLOTS * SLOT_CONTEXT, None)
    with (
        running(lambda: start_peer(args, binary, gguf, config, "--jinja", "--alias", "default"),
                args.ready_timeout) as peer,
        tempfile.TemporaryDirectory(prefix="bench-relay-llamacpp-") as tmp,
    ):  # fmt: skip
        logs = Path(tmp)
        redis = EmbeddedRedis(logs / "redis").start()
        port, procs = free_port(), []
        try:
            cli = ["-m", "tokenrelay.core.cli"]
            procs.append(start([*cli, "worker", "--redis-url", redis.url, "--redis-prefix",
                                PREFIX, "--upstream", f"{peer.url}/v1", "--max-inflight",
                                str(SLOTS * 2)], logs / "worker.log"))  # fmt: skip
            procs.append(start([*cli, "gateway", "--redis-url", redis.url, "--redis-prefix",
                                PREFIX, "--port", str(port)], logs / "gateway.log"))  # fmt: skip
            relay = f"http://127.0.0.1:{port}"
            wait_http(f"{relay}/readyz", procs[-1])
            result = asyncio.run(measure(args, peer.url, relay))
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(20)
            redis.stop()
    return {"machine": machine(), "load": load_average(), "upstream": PEER,
            "tokens": args.tokens, "config": config.describe_peer(), **result}  # fmt: skip


def table(result: dict[str, Any]) -> str:
    rows = {(lv["streams"], lv["path"]): lv for lv in result["levels"]}
    lines = [
        SECTION, "",
        f"{result['machine']}; load {result['load']}; llama-server {result['config']}, "
        f"the default model; {result['tokens']} tokens per stream",
        "",
        "| streams | direct TTFT p50 | relay TTFT p50 | direct ITL p50 | relay ITL p50 "
        "| direct ITL p99 | relay ITL p99 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]  # fmt: skip
    for n in sorted({s for s, _ in rows}):
        d, r = rows[(n, "direct")], rows[(n, "relay")]
        lines.append(f"| {n} | {d['ttft_p50']:.1f} ms | {r['ttft_p50']:.1f} ms | "
                     f"{d['itl_p50']:.1f} ms | {r['itl_p50']:.1f} ms | {d['itl_p99']:.1f} ms | "
                     f"{r['itl_p99']:.1f} ms |")  # fmt: skip
    lines += ["", "| feature | direct | relay | same |", "| --- | --- | --- | --- |"]
    for name, f in result["features"].items():
        direct, relay = (json.dumps(f[k], ensure_ascii=False)[:120] for k in ("direct", "relay"))
        lines.append(f"| {name} | `{direct}` | `{relay}` | {'yes' if f['same'] else 'no'} |")
    return "\n".join(lines)
