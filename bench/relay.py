"""The per-token latency a relay adds: client <- gateway <- Redis <- relay worker <- upstream.

One run, for each level of N concurrent streams (1 and 32 by default):

* direct: N streaming ``POST /v1/chat/completions`` to the upstream itself;
* relay: the same N requests to a ``tokenrelay gateway`` process, whose
  ``tokenrelay worker --upstream`` process makes them to the same upstream, over an
  embedded redis-server.

The upstream is a synthetic OpenAI-compatible server in a process of its own (raw
asyncio HTTP/1.1, chunked server-sent events): each stream sends ``--tokens`` chunks,
one every ``--interval`` seconds on a fixed schedule, and each chunk's text is the
``CLOCK_MONOTONIC`` nanoseconds at which it was written (``<123...>``). The client (one
asyncio process, httpx, SSE parsed the same way on both paths) takes the clock when a
line arrives: the token's latency is the difference (one machine, one clock). A relay
may merge chunks that arrive within one worker step into one event: every stamp in an
event counts. Reported: p50 and p99 per path and level, and the relay's added ms and
ratio; every token must arrive, in order, on both paths.

    .venv/bin/python -m bench.relay                  # 1 and 32 streams, 200 tokens each
    .venv/bin/python -m bench.relay --levels 1,2 --tokens 10 --interval 0.01 --json out.json

``--upstream llamacpp`` relays to llama.cpp's ``llama-server`` on the default model
instead, and checks what the relay passes on (bench/relay_llamacpp.py says what it does):

    .venv/bin/python -m bench.relay --upstream llamacpp --levels 1,4 --tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import ROOT, load_average, load_generator_gc, machine
from tokenrelay.core.redis.embedded import EmbeddedRedis

SECTION = "## Relay latency"
PREFIX = "benchrelay:"
MODEL = "synthetic"
STAMP = re.compile(r"<(\d+)>")


# --- the synthetic upstream -----------------------------------------------------------


def _sse_chunk(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    event = f"data: {data}\n\n".encode()
    return b"%x\r\n%s\r\n" % (len(event), event)


def _delta(content: str | None, finish: str | None) -> dict[str, Any]:
    delta = {"content": content} if content is not None else {}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {"id": "x", "object": "chat.completion.chunk", "model": MODEL, "choices": [choice]}


async def _stream(writer: asyncio.StreamWriter, tokens: int, interval: float) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
    start = time.monotonic()
    for k in range(tokens):
        await asyncio.sleep(max(0.0, start + k * interval - time.monotonic()))
        writer.write(_sse_chunk(_delta(f"<{time.monotonic_ns()}>", None)))
        await writer.drain()
    writer.write(_sse_chunk(_delta(None, "length")))
    usage = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}
    writer.write(_sse_chunk({"id": "x", "object": "chat.completion.chunk", "model": MODEL,
                             "choices": [], "usage": usage}))  # fmt: skip
    writer.write(_sse_chunk("[DONE]") + b"0\r\n\r\n")
    await writer.drain()


async def _connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      interval: float) -> None:  # fmt: skip
    """Serve one keep-alive connection: ``GET .../models`` and streaming completions."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ValueError):
        while True:
            line = await reader.readline()
            if not line:
                return
            headers: dict[str, str] = {}
            while (h := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = h.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if line.split()[1].endswith(b"/models"):
                out = json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(out), out))  # fmt: skip
                continue
            await _stream(writer, int(json.loads(body).get("max_tokens", 16)), interval)
    writer.close()


def serve_upstream(port: int, interval: float) -> None:
    """Run the synthetic upstream on ``port`` until killed (``--serve-upstream``)."""

    async def main() -> None:
        server = await asyncio.start_server(
            lambda r, w: _connection(r, w, interval), "127.0.0.1", port, backlog=1024
        )
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# --- the processes ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENRELAY_LOG_LEVEL": "warning"},
        )  # fmt: skip


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready in {timeout:g} s")


# --- the client ------------------------------------------------------------------------


@dataclass
class PathResult:
    """One path at one level: every token's latency (ms), and what went wrong."""

    path: str
    streams: int
    latencies_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies_ms)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def one_stream(client: httpx.AsyncClient, url: str, tokens: int, out: PathResult) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}],
            "max_tokens": tokens, "stream": True, "temperature": 0}  # fmt: skip
    stamps: list[int] = []
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                out.errors.append(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                return
            async for line in resp.aiter_lines():
                now = time.monotonic_ns()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    for raw in STAMP.findall(choice.get("delta", {}).get("content") or ""):
                        stamps.append(int(raw))
                        out.latencies_ms.append((now - int(raw)) / 1e6)
    except httpx.HTTPError as exc:
        out.errors.append(repr(exc))
    out.tokens += len(stamps)
    if stamps != sorted(stamps):
        out.errors.append("tokens out of order")
    if len(stamps) != tokens:
        out.errors.append(f"{len(stamps)} of {tokens} tokens")


async def measure(path: str, url: str, streams: int, tokens: int) -> PathResult:
    out = PathResult(path, streams)
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=60, limits=limits, trust_env=False) as client:
        await one_stream(client, url, 4, PathResult(path, 1))  # warm: connections, the model
        with load_generator_gc():
            await asyncio.gather(*(one_stream(client, url, tokens, out) for _ in range(streams)))
    return out


# --- the run ---------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    levels = [int(n) for n in args.levels.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-relay-") as tmp:
        logs = Path(tmp)
        redis = EmbeddedRedis(logs / "redis").start()
        up_port, gw_port = free_port(), free_port()
        procs = [start(["-m", "bench.relay", "--serve-upstream", str(up_port),
                        "--interval", str(args.interval)], logs / "upstream.log")]  # fmt: skip
        try:
            upstream = f"http://127.0.0.1:{up_port}/v1"
            wait_http(f"{upstream}/models", procs[0])
            common = ["-m", "tokenrelay.core.cli"]
            procs.append(start([*common, "worker", "--redis-url", redis.url, "--redis-prefix",
                                PREFIX, "--upstream", upstream, "--max-inflight",
                                str(max(levels) + 8)], logs / "worker.log"))  # fmt: skip
            procs.append(start([*common, "gateway", "--redis-url", redis.url, "--redis-prefix",
                                PREFIX, "--port", str(gw_port)], logs / "gateway.log"))  # fmt: skip
            relay = f"http://127.0.0.1:{gw_port}/v1"
            wait_http(f"http://127.0.0.1:{gw_port}/readyz", procs[-1])
            results = []
            for n in levels:
                for path, base in (("direct", upstream), ("relay", relay)):
                    url = f"{base}/chat/completions"
                    results.append(asyncio.run(measure(path, url, n, args.tokens)))
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(20)
            redis.stop()
    return {
        "machine": machine(),
        "load": load_average(),
        "tokens": args.tokens,
        "interval_s": args.interval,
        "levels": [
            {
                "path": r.path,
                "streams": r.streams,
                "tokens": r.tokens,
                "errors": r.errors[:5],
                "p50_ms": round(r.pct(0.5), 3),
                "p99_ms": round(r.pct(0.99), 3),
            }
            for r in results
        ],
    }


def table(result: dict[str, Any]) -> str:
    rows = {(lv["streams"], lv["path"]): lv for lv in result["levels"]}
    lines = [
        SECTION, "",
        f"{result['machine']}; load {result['load']}; {result['tokens']} tokens per stream, "
        f"one every {result['interval_s'] * 1000:g} ms",
        "",
        "| streams | direct p50 | relay p50 | added p50 | ratio p50 "
        "| direct p99 | relay p99 | added p99 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]  # fmt: skip
    for n in sorted({s for s, _ in rows}):
        d, r = rows[(n, "direct")], rows[(n, "relay")]
        ratio = r["p50_ms"] / d["p50_ms"] if d["p50_ms"] else float("nan")
        lines.append(
            f"| {n} | {d['p50_ms']:.2f} ms | {r['p50_ms']:.2f} ms | "
            f"{r['p50_ms'] - d['p50_ms']:+.2f} ms | {ratio:.1f}x | {d['p99_ms']:.2f} ms | "
            f"{r['p99_ms']:.2f} ms | {r['p99_ms'] - d['p99_ms']:+.2f} ms |"
        )
    errors = [f"{lv['path']} x{lv['streams']}: {lv['errors']}" for lv in result["levels"]
              if lv["errors"]]  # fmt: skip
    return "\n".join(lines + (["", *errors] if errors else []))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="1,32", help="concurrent streams, a comma list")
    p.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    p.add_argument("--interval", type=float, default=0.02, help="seconds between tokens")
    p.add_argument("--json", default=None, help="also write the result as JSON here")
    p.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--upstream", choices=("synthetic", "llamacpp"), default="synthetic",
                   help="the upstream: the synthetic server, or llama-server")  # fmt: skip
    from bench import relay_llamacpp  # (it imports this module)

    relay_llamacpp.add_options(p)
    args = p.parse_args()
    if args.serve_upstream is not None:
        serve_upstream(args.serve_upstream, args.interval)
        return 0
    if args.upstream == "llamacpp":
        result = relay_llamacpp.run_llamacpp(args)
        print(relay_llamacpp.table(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return 1 if not all(f["same"] for k, f in result["features"].items()
                            if k != "image") else 0  # fmt: skip
    result = run(args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if any(lv["errors"] for lv in result["levels"]) else 0


if __name__ == "__main__":
    sys.exit(main())
