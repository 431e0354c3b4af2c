"""The HTTP API's overhead: the same requests through ``tokenrelay serve`` and in-process.

For 1, 8, 32 and 64 concurrent streams (all started at once; greedy, EOS
ignored, ``--max-tokens`` tokens each, a distinct chat prompt per request),
measure time to first token (TTFT), time per output token (TPOT, per
request), inter-token latency (ITL, the gaps between text pieces as the
client sees them) and output throughput:

* engine: ``engine.llm_engine.LLMEngine`` driven with ``step()`` in this
  process (the floor: no Redis, no HTTP, no second process);
* api: ``tokenrelay serve`` as a subprocess (embedded Redis, one engine
  worker, the gateway), httpx async streaming ``POST /v1/chat/completions``.

Both use the same prompts (the chat template applied the same way), the same
model and device. Each level runs on both paths back to back (alternating
which goes first; ``--repeats`` rounds, the median one reported), never at
the same time, so both see the same machine load; the idle server costs next
to nothing meanwhile. The report gives the 1-minute load average before and
after.

    .venv/bin/python -m bench.api_overhead          # the full run
    .venv/bin/python -m bench.api_overhead --quick  # a smaller one
    .venv/bin/python -m bench.api_overhead --out    # also save the report in bench/results/
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common import ROOT, machine, result_path, write_result
from tokenrelay.gateway.http.sse import SSEParser

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads

TOPICS = (
    "rivers", "volcanoes", "bread", "chess", "owls", "trains", "glaciers", "jazz", "bees",
    "lighthouses", "comets", "tea", "maps", "coral", "violins", "deserts",
)  # fmt: skip
SECTION = "## HTTP API overhead"


def messages(i: int) -> list[dict[str, str]]:
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"Request {i}: write a short paragraph about {topic}."}]


@dataclass
class Stream:
    """Client-side timings of one request (seconds, perf_counter)."""

    start: float
    pieces: list[float] = field(default_factory=list)  # arrival of each text piece
    tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.pieces[0] - self.start

    @property
    def tpot(self) -> float | None:
        if self.tokens < 2:
            return None
        return (self.pieces[-1] - self.pieces[0]) / (self.tokens - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.pieces, self.pieces[1:], strict=False)]


@dataclass
class Level:
    """All streams of one concurrency level, on one path."""

    concurrency: int
    streams: list[Stream]
    wall: float

    def pct(self, values: list[float], p: float) -> float:
        if not values:
            return float("nan")
        xs = sorted(values)
        k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
        return xs[k] * 1000

    def summary(self) -> dict[str, float]:
        ttft = [s.ttft for s in self.streams]
        tpot = [t for s in self.streams if (t := s.tpot) is not None]
        itl = [g for s in self.streams for g in s.itl]
        tokens = sum(s.tokens for s in self.streams)
        out = {"tok_s": tokens / self.wall, "tokens": float(tokens)}
        for p in (50, 90, 99):
            out[f"ttft_p{p}"] = self.pct(ttft, p)
            out[f"tpot_p{p}"] = self.pct(tpot, p)
            out[f"itl_p{p}"] = self.pct(itl, p)
        return out


# --- engine, in process -----------------------------------------------------------


class EngineRunner:
    """``LLMEngine`` in this process, driven with ``step()``."""

    def __init__(self, args: argparse.Namespace) -> None:
        from tokenrelay.engine.config import EngineConfig
        from tokenrelay.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(EngineConfig(model=args.model, device=args.device, max_num_seqs=64))

    def batch(self, first: int, n: int, max_tokens: int) -> Level:
        """``n`` requests added at once (prompts ``first``..), stepped to the end."""
        from tokenrelay.core.wire.params import SamplingParams

        engine = self.engine
        p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        prompts = [engine.apply_chat_template(messages(first + i)) for i in range(n)]
        t0 = time.perf_counter()
        streams = {}
        for i, ids in enumerate(prompts):
            rid = f"b{first + i}"
            engine.add_request(rid, ids, p)
            streams[rid] = Stream(t0)
        while engine.has_unfinished():
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                s = streams[out.request_id]
                if out.new_text:
                    s.pieces.append(now)
                s.tokens = out.completion_tokens
        return Level(n, list(streams.values()), time.perf_counter() - t0)


# --- the HTTP API, through `tokenrelay serve` ---------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``tokenrelay serve`` in a subprocess (its own embedded Redis in a temp dir)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="tokenrelay-bench-"))
        cmd = [sys.executable, "-m", "tokenrelay.core.cli", "serve", "--port", str(self.port),
               "--device", args.device, "--model", args.model, "--data-dir", str(self.dir),
               "--max-num-seqs", "64", "--log-level", "warning"]  # fmt: skip
        self.log = open(self.dir / "serve.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError((self.dir / "serve.log").read_text()[-3000:])
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("tokenrelay serve did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


async def one_stream(client: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> Stream:
    body = {"model": "default", "messages": messages(i), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    s = Stream(time.perf_counter())
    parser = SSEParser()
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for chunk in resp.aiter_bytes():
            now = time.perf_counter()
            for ev in parser.feed(chunk):
                if ev.data == "[DONE]":
                    return s
                obj = json.loads(ev.data)
                if obj.get("usage"):
                    s.tokens = obj["usage"]["completion_tokens"]
                for choice in obj.get("choices", []):
                    if choice["delta"].get("content"):
                        s.pieces.append(now)
    raise RuntimeError("the stream ended without [DONE]")


async def api_batch(
    client: httpx.AsyncClient, url: str, first: int, n: int, max_tokens: int
) -> Level:
    """``n`` streaming requests sent at once (prompts ``first``..)."""
    t0 = time.perf_counter()
    streams = await asyncio.gather(
        *(one_stream(client, url, first + i, max_tokens) for i in range(n))
    )
    return Level(n, list(streams), time.perf_counter() - t0)


def median_round(rounds: list[Level]) -> Level:
    """The round with the median wall time (robust to a load spike on a shared machine)."""
    return sorted(rounds, key=lambda lvl: lvl.wall)[(len(rounds) - 1) // 2]


async def interleaved(
    args: argparse.Namespace, levels: list[int], runner: EngineRunner, url: str
) -> tuple[dict[int, Level], dict[int, Level]]:
    """Each level on both paths back to back (alternating which goes first), so both
    see the same machine load; ``--repeats`` rounds per level, the median one kept."""
    rounds: dict[str, dict[int, list[Level]]] = {"engine": {}, "api": {}}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
        runner.batch(100_000, 2, 4)  # warm-up, both paths
        await api_batch(client, url, 100_000, 2, 4)
        for c in levels:
            for r in range(args.repeats):
                first = 1000 * c + 100 * r  # the same prompts on both paths
                order = ("engine", "api") if r % 2 == 0 else ("api", "engine")
                for path in order:
                    if path == "engine":
                        lvl = runner.batch(first, c, args.max_tokens)
                    else:
                        lvl = await api_batch(client, url, first, c, args.max_tokens)
                    rounds[path].setdefault(c, []).append(lvl)
                    print(f"  c={c:<3} round {r} {path:6s} {lvl.wall:7.2f}s", flush=True)
    engine = {c: median_round(rs) for c, rs in rounds["engine"].items()}
    api = {c: median_round(rs) for c, rs in rounds["api"].items()}
    return engine, api


# --- report ------------------------------------------------------------------------


def table(engine: dict[int, Level], api: dict[int, Level]) -> str:
    head = (
        "| streams | path | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) "
        "| ITL p50 / p90 / p99 (ms) | output tok/s |\n"
        "|---:|---|---:|---:|---:|---:|\n"
    )
    rows = []

    def trio(s: dict[str, float], key: str) -> str:
        return " / ".join(f"{s[f'{key}_p{p}']:.1f}" for p in (50, 90, 99))

    for c in sorted(engine):
        e, a = engine[c].summary(), api[c].summary()
        for name, s in (("engine", e), ("api", a)):
            rows.append(
                f"| {c} | {name} | {trio(s, 'ttft')} | {trio(s, 'tpot')} | {trio(s, 'itl')} "
                f"| {s['tok_s']:.1f} |"
            )
        rows.append(
            f"| {c} | api / engine | {a['ttft_p50'] / e['ttft_p50']:.2f}x "
            f"| {a['tpot_p50'] / e['tpot_p50']:.2f}x | {a['itl_p50'] / e['itl_p50']:.2f}x "
            f"| {a['tok_s'] / e['tok_s']:.2f}x |"
        )
    return head + "\n".join(rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.api_overhead", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="1 and 8 streams, 16 tokens each")
    ap.add_argument("--levels", default=None, help="comma-separated concurrency levels")
    ap.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per request (32; 16 with --quick)"
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default="default")
    ap.add_argument("--repeats", type=int, default=None, help="rounds per level (3; 1 quick)")
    ap.add_argument(
        "--out",
        nargs="?",
        const=str(result_path("api_overhead.md")),
        default=None,
        help="also write the report here (bench/results/api_overhead.md if no path is given)",
    )
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")] if args.levels else (
        [1, 8] if args.quick else [1, 8, 32, 64])  # fmt: skip
    if args.max_tokens is None:
        args.max_tokens = 16 if args.quick else 32
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    import torch

    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    args.device = device
    where = torch.cuda.get_device_name(0) if device.startswith("cuda") else machine()
    print(f"device {device} ({where}); levels {levels}; {args.max_tokens} tokens per request")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server on the way out
    load_before = os.getloadavg()[0]
    server = Server(args)  # loads its model while this process loads its own
    try:
        print("loading the engine in process and `tokenrelay serve` ...", flush=True)
        runner = EngineRunner(args)
        server.wait_ready()
        engine, api = asyncio.run(interleaved(args, levels, runner, server.url))
    finally:
        server.stop()
    result = table(engine, api)
    cmd = " ".join(["python -m bench.api_overhead", *sys.argv[1:]])
    report = (
        f"{SECTION}\n\n"
        f"`{cmd}` on {where} (device `{device}`, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}). {args.max_tokens} output tokens per request (greedy, "
        f"EOS ignored), every stream started at once with its own chat prompt; {args.repeats} "
        "round(s) per level, the two paths back to back, the round with the median wall "
        "time shown. *engine*: "
        "`LLMEngine.step()` in process; *api*: `tokenrelay serve` (embedded Redis, one "
        "worker process, the gateway) over httpx async SSE streaming. TTFT from sending to "
        "the first text; TPOT per request ((last - first) / (tokens - 1)); ITL between the "
        f"text pieces a client receives. 1-minute load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after (the machine is shared).\n\n" + result
    )
    print()
    print(report)
    if args.out:
        write_result(Path(args.out), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
