"""The gateway's streaming overhead: N WebSocket clients against a real gateway and a bare server.

For each level of N concurrent streams (100 and 1,000 by default), in one run:

* gateway: an embedded redis-server, a real ``tokenrelay gateway`` process
  (``python -m tokenrelay.core.cli gateway``) and the load-test token source of
  bench/token_source.py, which creates N running streams in Redis the way an
  engine worker does and appends one token event to every stream per tick
  (one pipelined round trip per tick, like a worker step) at ``--rate`` tokens
  per second per stream. N clients (one asyncio process on uvloop; each a
  bench/ws_client.py ``LightClient``: ``websockets``' sans-I/O protocol, every
  frame handled in a callback, no task per message) each ``resume`` their stream with
  ``after: 0`` before the first token and read it to its ``done``.
* bare: a bare ``websockets`` server in its own process, on uvloop as the
  gateway is (no Redis, no Starlette), pushing the same frames at the same
  rate to the same N clients: the ceiling.

Measured: delivered token events/s, the latency added between the token
source's tick (its append to Redis, or its send for the bare server) and the
client's receipt (when the frame's bytes reached the client process; p50 /
p99; every event carries its tick's timestamp), CPU (% of one core, over the
streaming window) and peak RSS of the server process (and of redis-server and
the client process), and whether every event arrived once and in order. Then
the resume time: from sending ``resume`` (``after: 0``) to the last replayed
event of a finished stream with a ``--backlog``-event log.

    .venv/bin/python -m bench.gateway          # 100 and 1,000 streams, 10 s each
    .venv/bin/python -m bench.gateway --quick  # 100 streams, 3 s
    .venv/bin/python -m bench.gateway --out    # also save the report in bench/results/
    .venv/bin/python -m bench.gateway --quick --tracing  # + a gateway with --otlp-endpoint

With ``--tracing`` each level also runs against a second gateway started with
``--otlp-endpoint`` (its spans go to a sink process that answers every export with 200),
in the same run: *gateway+tracing*, compared with *gateway* in the verdicts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import connect

from bench.common import ROOT, load_generator_gc, machine, result_path, write_result
from bench.token_source import backlog_stream, parse_stamp
from bench.ws_client import LightClient
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.gateway.server import loop_factory
from tokenrelay.worker.store import WorkerStore

SECTION = "## Gateway"
PREFIX = "bench:"
CLK_TCK = os.sysconf("SC_CLK_TCK")
CONNECT_CONCURRENCY = 64


# --- machine and /proc ------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (seconds)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat


def runq_seconds(pid: int) -> dict[str, float]:
    """Per thread of ``pid``: time spent runnable but waiting for a CPU (seconds).

    The second field of each thread's ``schedstat``: the run-queue delay, which is
    what CPU contention between the processes of the benchmark adds to latency. Per
    thread, so a window counts only threads alive at its end, from where each stood at
    its start (a thread that exits mid-window must not take its earlier wait with it).
    """
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            out[task.name] = int((task / "schedstat").read_text().split()[1]) / 1e9
    return out


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Watch:
    """CPU and run-queue wait over a window, and peak RSS (sampled), of a few processes."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        self.runq0 = {k: runq_seconds(p) for k, p in pids.items()}
        self.peak = {k: rss_mib(p) for k, p in pids.items()}
        self.t0 = time.monotonic()

    def sample(self) -> None:
        for k, p in self.pids.items():
            with contextlib.suppress(OSError):
                self.peak[k] = max(self.peak[k], rss_mib(p))

    async def sampler(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)

    def _per_second(
        self, read: Callable[[int], float], start: dict[str, float]
    ) -> dict[str, float]:
        wall = time.monotonic() - self.t0
        return {k: (read(p) - start[k]) / wall for k, p in self.pids.items()}

    def cpu_pct(self) -> dict[str, float]:
        return {k: v * 100 for k, v in self._per_second(cpu_seconds, self.cpu0).items()}

    def runq_ms_per_s(self) -> dict[str, float]:
        """Milliseconds per second of the window each process waited for a CPU."""
        wall = time.monotonic() - self.t0
        out = {}
        for k, p in self.pids.items():
            now, start = runq_seconds(p), self.runq0[k]
            waited = sum(max(0.0, v - start.get(tid, 0.0)) for tid, v in now.items())
            out[k] = waited / wall * 1000
        return out


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    xs = sorted(values)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


# --- child processes ------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Child:
    """A child process driven over stdin/stdout JSON lines (``python -m bench.token_source``)."""

    def __init__(self, args: list[str], log: Path) -> None:
        self._err = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.token_source", *args],
            cwd=ROOT,  # the repository root, so that ``-m bench.token_source`` imports
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
        )
        self.log = log

    async def line(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        loop = asyncio.get_running_loop()
        raw = await asyncio.wait_for(loop.run_in_executor(None, self.proc.stdout.readline), timeout)
        if not raw:
            self.proc.wait(5)
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"token source exited ({self.proc.returncode}):\n{tail}")
        return dict(json.loads(raw))

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


def start_gateway(redis_url: str, port: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    args = [
        sys.executable, "-m", "tokenrelay.core.cli", "gateway",
        "--redis-url", redis_url, "--redis-prefix", PREFIX,
        "--host", "127.0.0.1", "--port", str(port),
        "--stream-ttl", "600", "--detach-timeout", "600",
        "--max-connections", "20000", "--log-level", "warning", "--log-format", "json",
        *extra,
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    with open(log, "ab") as out:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


# An OTLP/HTTP sink for --tracing: answers every export with 200 and keeps nothing.
SINK = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited early ({proc.returncode})")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError("gateway not healthy")


def stop_proc(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- clients ------------------------------------------------------------------------


@dataclass
class Tally:
    """What all clients of one level received."""

    events: int
    latencies: list[float] = field(default_factory=list)  # seconds
    received: int = 0
    errors: list[str] = field(default_factory=list)
    last_receipt: float = 0.0
    done: int = 0
    first_of_tick: dict[str, float] = field(default_factory=dict)  # tick stamp -> first latency


async def open_client(url: str, sid: str, token: str, sem: asyncio.Semaphore) -> LightClient:
    async with sem:
        ws = await LightClient.open(url, 60)
        hello = json.loads((await ws.recv(30))[0])
        assert hello["type"] == "hello", hello
        ws.send(json.dumps({"type": "resume", "stream_id": sid, "resume_token": token, "after": 0}))
        resumed = json.loads((await ws.recv(30))[0])
        assert resumed["type"] == "resumed", resumed
        return ws


class StreamCheck:
    """One stream's frames as they arrive: in order, once each, then ``done``; tallied."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.expected = 1
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_text(self, msg: str, now: float) -> None:
        tally = self.tally
        try:
            f = json.loads(msg)
            kind = f["type"]
            if kind == "token":
                if f["seq"] != self.expected:
                    tally.errors.append(f"seq {f['seq']} where {self.expected} was due")
                self.expected = f["seq"] + 1
                text = f["text"]
                lat = now - parse_stamp(text)
                tally.latencies.append(lat)
                tally.first_of_tick.setdefault(text, lat)  # every tick has its own stamp
                tally.received += 1
                tally.last_receipt = now
            elif kind == "done":
                if f["seq"] != tally.events + 1 or self.expected != tally.events + 1:
                    tally.errors.append(f"done at seq {f['seq']} after {self.expected - 1} tokens")
                tally.done += 1
                tally.last_receipt = now
                if not self.finished.done():
                    self.finished.set_result(None)
            else:
                tally.errors.append(f"unexpected frame {msg[:200]}")
        except Exception as exc:  # a malformed frame is a finding, not a crash of the client
            tally.errors.append(f"bad frame {msg[:200]!r}: {exc!r}")


async def read_stream(ws: LightClient, tally: Tally) -> None:
    check = StreamCheck(tally)
    ws.stream(check.on_text)
    try:
        await asyncio.wait({check.finished, ws.closed}, return_when=asyncio.FIRST_COMPLETED)
        if not check.finished.done():
            tally.errors.append(f"socket closed after {check.expected - 1} tokens, before done")
    finally:
        await ws.close()


@dataclass
class LevelResult:
    streams: int
    server: str
    events_per_stream: int
    rate: float
    delivered: int
    expected: int
    errors: list[str]
    window_s: float
    lat_ms: tuple[float, float, float]  # p50, p99, max
    first_ms: tuple[float, float]  # latency of each tick's first delivered event: p50, p99
    cpu: dict[str, float]
    runq: dict[str, float]  # ms per s of the window spent waiting for a CPU
    rss: dict[str, float]
    source_ms: tuple[float, float]  # tick hand-over p50, p99

    @property
    def events_per_s(self) -> float:
        return self.delivered / self.window_s if self.window_s > 0 else 0.0


async def run_level(
    server: str,
    n: int,
    rate: float,
    events: int,
    *,
    redis: EmbeddedRedis,
    gw_pid: int,
    gw_port: int,
    logs: Path,
    groups: int = 1,
) -> LevelResult:
    common = ["--streams", str(n), "--rate", str(rate), "--events", str(events)]
    common += ["--groups", str(groups)]
    if server == "gateway":
        child = Child(
            ["redis", "--redis-url", redis.url, "--prefix", PREFIX, *common], logs / "src.log"
        )
    else:
        child = Child(["bare", *common], logs / "bare.log")
    tally = Tally(events)
    conns: list[LightClient] = []
    readers: list[asyncio.Task[None]] = []
    try:
        ready = await child.line(120)
        if server == "gateway":
            url = f"ws://127.0.0.1:{gw_port}/v1/ws"
            targets = [(s, t) for s, t in ready["streams"]]
            pids = {"server": gw_pid, "redis": redis.proc.pid if redis.proc else 0}
            pids["source"] = child.proc.pid
        else:
            url = f"ws://127.0.0.1:{ready['port']}/"
            targets = [(f"bare{i:018d}", "x") for i in range(n)]
            pids = {"server": int(ready["pid"])}
        pids["client"] = os.getpid()
        sem = asyncio.Semaphore(CONNECT_CONCURRENCY)
        conns = list(await asyncio.gather(*(open_client(url, s, t, sem) for s, t in targets)))
        readers = [asyncio.create_task(read_stream(ws, tally)) for ws in conns]
        with load_generator_gc():
            watch = Watch(pids)
            stop = asyncio.Event()
            sampler = asyncio.create_task(watch.sampler(stop))
            t_go = time.time()
            child.go()
            budget = events / rate * 4 + 60
            stats = await child.line(budget)
            done, pending = await asyncio.wait(readers, timeout=budget)
            for task in pending:
                task.cancel()
            for task in done:
                if task.exception() is not None:
                    tally.errors.append(f"client failed: {task.exception()!r}")
            if pending:
                tally.errors.append(f"{len(pending)} clients did not finish in {budget:.0f} s")
            cpu = watch.cpu_pct()
            runq = watch.runq_ms_per_s()
            stop.set()
            await sampler
    finally:
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        for ws in conns:
            with contextlib.suppress(Exception):
                await ws.close()
        child.stop()
    lat = [x * 1000 for x in tally.latencies]
    first = [x * 1000 for x in tally.first_of_tick.values()]
    flush = list(stats["flush_ms"])
    return LevelResult(
        streams=n,
        server=server,
        events_per_stream=events,
        rate=rate,
        delivered=tally.received,
        expected=n * events,
        errors=tally.errors,
        window_s=tally.last_receipt - t_go,
        lat_ms=(pct(lat, 50), pct(lat, 99), max(lat, default=float("nan"))),
        first_ms=(pct(first, 50), pct(first, 99)),
        cpu=cpu,
        runq=runq,
        rss=watch.peak,
        source_ms=(pct(flush, 50), pct(flush, 99)),
    )


async def measure_resume(
    redis: EmbeddedRedis, gw_port: int, backlog: int, reps: int
) -> tuple[list[float], list[str]]:
    """Seconds from sending ``resume`` to the last replayed event, ``reps`` times."""
    store = WorkerStore(redis.url, "bench-backlog", prefix=PREFIX)
    try:
        sid, token = backlog_stream(store, backlog, 600.0)
    finally:
        store.close()
    times: list[float] = []
    errors: list[str] = []
    for _ in range(reps):
        async with connect(
            f"ws://127.0.0.1:{gw_port}/v1/ws", max_size=None, compression=None
        ) as ws:
            assert json.loads(await ws.recv())["type"] == "hello"
            frame = {"type": "resume", "stream_id": sid, "resume_token": token, "after": 0}
            t0 = time.perf_counter()
            await ws.send(json.dumps(frame))
            seqs: list[int] = []
            while True:
                f = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if f["type"] == "token":
                    seqs.append(f["seq"])
                    if f["seq"] == backlog:
                        times.append(time.perf_counter() - t0)
                elif f["type"] == "done":
                    break
            if seqs != list(range(1, backlog + 1)):
                errors.append(f"resume replayed {len(seqs)} events, not 1..{backlog} in order")
    return times, errors


# --- report -------------------------------------------------------------------------


def level_table(results: list[LevelResult]) -> str:
    rows = [
        "| streams | server | events/s (offered) | vs bare | added latency p50 / p99 / max (ms) "
        "| first of tick p50 / p99 (ms) | server CPU % | server peak RSS (MiB) | redis CPU % "
        "| client CPU % | waiting for a CPU, ms/s: server / redis / source / client "
        "| tick hand-over p50 / p99 (ms) | all delivered in order |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    bare = {r.streams: r for r in results if r.server == "bare"}
    for r in results:
        ref = bare.get(r.streams)
        ratio = f"{r.events_per_s / ref.events_per_s:.2f}x" if ref and ref.events_per_s else "-"
        ok = "yes" if not r.errors and r.delivered == r.expected else (
            f"no: {r.delivered}/{r.expected}, {len(r.errors)} errors")  # fmt: skip
        redis_cpu = f"{r.cpu['redis']:.0f}" if "redis" in r.cpu else "-"
        who = ("server", "redis", "source", "client")
        wait = " / ".join(f"{r.runq[k]:.0f}" if k in r.runq else "-" for k in who)
        rows.append(
            f"| {r.streams:,} | {r.server} | {r.events_per_s:,.0f} ({r.streams * r.rate:,.0f}) "
            f"| {ratio if r.server.startswith('gateway') else '1.00x'} "
            f"| {r.lat_ms[0]:.1f} / {r.lat_ms[1]:.1f} / {r.lat_ms[2]:.1f} "
            f"| {r.first_ms[0]:.1f} / {r.first_ms[1]:.1f} "
            f"| {r.cpu['server']:.0f} | {r.rss['server']:.0f} | {redis_cpu} "
            f"| {r.cpu['client']:.0f} | {wait} "
            f"| {r.source_ms[0]:.1f} / {r.source_ms[1]:.1f} | {ok} |"
        )
    return "\n".join(rows)


def verdicts(results: list[LevelResult], groups: int = 1) -> list[str]:
    out = []
    bare = {r.streams: r for r in results if r.server == "bare"}
    for r in results:
        if r.server != "gateway":
            continue
        ref = bare.get(r.streams)
        if ref and ref.events_per_s:
            ratio = r.events_per_s / ref.events_per_s
            met = "met" if ratio >= 0.5 else "NOT met"
            out.append(
                f"{r.streams:,} streams: gateway/bare events/s {ratio:.3f} (target >= 0.50: {met})"
            )
        if r.streams >= 1000:
            met = "met" if r.lat_ms[1] <= 10 else "NOT met"
            out.append(
                f"{r.streams:,} streams: p99 added latency {r.lat_ms[1]:.1f} ms "
                f"(target <= 10 ms: {met})"
            )
        if r.events_per_s < 0.9 * r.streams * r.rate:
            out.append(
                f"{r.streams:,} streams: the gateway delivered {r.events_per_s:,.0f} of the "
                f"{r.streams * r.rate:,.0f} events/s offered: it fell behind"
            )
        if r.cpu["client"] >= 85:
            out.append(
                f"{r.streams:,} streams: the client process used {r.cpu['client']:.0f}% of a "
                "core; the clients may be part of the bottleneck"
            )
    plain = {r.streams: r for r in results if r.server == "gateway"}
    for r in results:
        ref = plain.get(r.streams)
        if r.server == "gateway+tracing" and ref and ref.events_per_s:
            out.append(
                f"{r.streams:,} streams: tracing on / off (same run): events/s "
                f"{r.events_per_s / ref.events_per_s:.3f}, added latency p50 "
                f"{r.lat_ms[0]:.1f} / {ref.lat_ms[0]:.1f} ms, p99 {r.lat_ms[1]:.1f} / "
                f"{ref.lat_ms[1]:.1f} ms, server CPU {r.cpu['server']:.0f}% / "
                f"{ref.cpu['server']:.0f}%"
            )
    for r in results:
        tick_ms = 1000 / r.rate / groups  # each group's hand-over has this long
        if r.source_ms[0] > tick_ms:
            who = "token source's pipelined append" if r.server != "bare" else (
                "bare server's sends")  # fmt: skip
            out.append(
                f"{r.streams:,} streams, {r.server}: the {who} took {r.source_ms[0]:.0f} ms "
                f"per tick (p50), more than the {tick_ms:.0f} ms a tick may take: the "
                "offered rate was not held"
            )
    return out


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    levels = [int(x) for x in args.levels.split(",")]
    events = max(1, round(args.seconds * args.rate))
    tmp = Path(tempfile.mkdtemp(prefix="tokenrelay-bench-gw-"))
    redis = EmbeddedRedis(tmp / "redis").start()
    port = free_port()
    gw = start_gateway(redis.url, port, tmp / "gateway.log")
    servers = {"bare": (gw, port), "gateway": (gw, port)}
    extra: list[subprocess.Popen[bytes]] = []
    if args.tracing:  # a second gateway, tracing to a sink (same Redis, same run)
        sink_port, traced_port = free_port(), free_port()
        extra.append(subprocess.Popen([sys.executable, "-c", SINK, str(sink_port)]))
        otlp = ("--otlp-endpoint", f"http://127.0.0.1:{sink_port}")
        traced = start_gateway(redis.url, traced_port, tmp / "gateway-traced.log", *otlp)
        extra.append(traced)
        servers["gateway+tracing"] = (traced, traced_port)
    results: list[LevelResult] = []
    try:
        for proc, p in servers.values():
            wait_healthy(p, proc)
        for n in levels:
            for server, (proc, p) in servers.items():
                r = await run_level(
                    "bare" if server == "bare" else "gateway",
                    n,
                    args.rate,
                    events,
                    redis=redis,
                    gw_pid=proc.pid,
                    gw_port=p,
                    logs=tmp,
                    groups=args.groups,
                )
                r.server = server
                print(
                    f"{n} streams, {server}: {r.events_per_s:,.0f} events/s, "
                    f"p50 {r.lat_ms[0]:.1f} ms, p99 {r.lat_ms[1]:.1f} ms, "
                    f"{r.delivered}/{r.expected} delivered, {len(r.errors)} errors",
                    flush=True,
                )
                for e in r.errors[:5]:
                    print("   ", e)
                results.append(r)
        resume_s, resume_errors = await measure_resume(redis, port, args.backlog, args.resume_reps)
    finally:
        stop_proc(gw)
        for proc in extra:
            stop_proc(proc)
        redis.stop()
        with contextlib.suppress(Exception):
            redis.cleanup()
    gw_log = (tmp / "gateway.log").read_text(errors="replace")
    return {
        "results": results,
        "resume_s": resume_s,
        "resume_errors": resume_errors,
        "events": events,
        "gateway_log_errors": [ln for ln in gw_log.splitlines() if '"ERROR"' in ln][:5],
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gateway", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="100 streams, 3 s, 3 resumes")
    ap.add_argument("--levels", default=None, help="comma-separated stream counts (100,1000)")
    ap.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream (20)")
    ap.add_argument("--seconds", type=float, default=None, help="streaming time per level (10)")
    ap.add_argument("--backlog", type=int, default=2000, help="events in the resumed stream")
    ap.add_argument("--resume-reps", type=int, default=None, help="resume repetitions (7)")
    ap.add_argument(
        "--groups",
        type=int,
        default=1,
        help="split the streams over G simulated engine workers with staggered steps (1)",
    )
    ap.add_argument(
        "--tracing",
        action="store_true",
        help="also run each level against a gateway with --otlp-endpoint (a sink)",
    )
    ap.add_argument("--json", default=None, help="also write the results here (JSON)")
    ap.add_argument(
        "--out",
        nargs="?",
        const=str(result_path("gateway.md")),
        default=None,
        help="also write the report here (bench/results/gateway.md if no path is given)",
    )
    args = ap.parse_args()
    args.levels = args.levels or ("100" if args.quick else "100,1000")
    args.seconds = args.seconds or (3.0 if args.quick else 10.0)
    args.resume_reps = args.resume_reps or (3 if args.quick else 7)
    load_before = os.getloadavg()[0]
    with asyncio.Runner(loop_factory=loop_factory()) as runner:  # uvloop, as the gateway
        out = runner.run(bench(args))
    load_after = os.getloadavg()[0]
    results: list[LevelResult] = out["results"]
    rs = [x * 1000 for x in out["resume_s"]]
    resume_table = (
        "| backlog (events) | resumes | resume → last replayed event p50 / min / max (ms) "
        "| replay events/s (p50) | all replayed in order |\n|---:|---:|---:|---:|---|\n"
        f"| {args.backlog:,} | {len(rs)} | {pct(rs, 50):.1f} / {min(rs, default=0):.1f} / "
        f"{max(rs, default=0):.1f} | {args.backlog / (pct(rs, 50) / 1000):,.0f} "
        f"| {'yes' if not out['resume_errors'] else 'no'} |"
    )
    cmd = "python -m bench.gateway " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    notes = verdicts(results, args.groups)
    cores = len(os.sched_getaffinity(0))
    if max(load_before, load_after) > cores:
        notes.append(
            f"the load average ({load_before:.1f} / {load_after:.1f}) was above the {cores} "
            "cores: processes were waiting for CPU, so the CPU % columns show each one's "
            "share of a contended machine and the timings are pessimistic"
        )
    in_step = (
        "all streams in step (one simulated engine worker, all its sequences advancing in "
        "the same step)"
        if args.groups == 1
        else f"the streams split over {args.groups} simulated engine workers whose steps are "
        "evenly staggered over the tick"
    )
    report = (
        f"{SECTION}\n\n"
        f"`{cmd.strip()}` on {machine()} ({time.strftime('%Y-%m-%d')}); Python "
        f"{platform.python_version()}. 1-minute load average {load_before:.1f} before, "
        f"{load_after:.1f} after: the machine is shared, and the gateway, redis-server, "
        "the token source and the clients all run on it.\n\n"
        f"Each level streams {out['events']} token events per stream at {args.rate:g} "
        f"tokens/s per stream, {in_step}. *gateway*: a `tokenrelay gateway` "
        "process on an embedded redis-server; the token source (bench/token_source.py, a "
        "load-test tool) appends one event to every stream of a worker per step in one "
        "pipelined round trip, as an engine worker does. *bare*: a bare `websockets` server "
        "process pushing the same frames at the same rate, no Redis, no Starlette: the "
        "ceiling. The bare server, the gateway and the clients run on uvloop. Clients: one "
        "asyncio process, one socket per stream (bench/ws_client.py: `websockets`' sans-I/O "
        "protocol, each frame handled in a callback, no task per message), each "
        "resuming its stream (`after: 0`) before the first token; an event's receipt is "
        "when its bytes reached the client process. Events/s: "
        "token events delivered / (last receipt - start), offered rate in brackets. Added "
        "latency: from the tick's hand-over (just before the Redis pipeline, or before the "
        "bare server's sends) to the client's receipt, so it includes the Redis append; "
        "first of tick: the added latency of the first event of each tick to reach any "
        "client (the fixed part of the path, before the fan-out to the tick's streams); "
        "tick hand-over: how long that pipeline (or the bare server's sends) took. CPU: % "
        "of one core over the streaming window. Waiting for a CPU: the time the process's "
        "threads were runnable but not running (the run-queue delay of `/proc/PID/task/*/"
        "schedstat`), in ms per second of the window: what the processes sharing the "
        "machine's cores cost each other. The client process and the token source "
        "run with the cyclic GC frozen during the window (bench/common.py "
        "`load_generator_gc`): their own pauses are not the server's latency."
        + (
            " *gateway+tracing*: a second gateway on the same Redis, started with "
            "`--otlp-endpoint` (spans exported to a sink process that answers 200), each "
            "client attachment one traced `gateway.resume` span."
            if args.tracing
            else ""
        )
        + "\n\n"
        f"{level_table(results)}\n\n"
        "Resume: a finished stream with a backlog, resumed with `after: 0` on an open "
        "socket; time from sending `resume` to receiving the last replayed token.\n\n"
        f"{resume_table}\n\n" + "".join(f"- {v}\n" for v in notes)
    )
    print()
    print(report)
    if out["gateway_log_errors"]:
        print("gateway logged errors:", *out["gateway_log_errors"], sep="\n  ")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "levels": [
                        {
                            "streams": r.streams,
                            "server": r.server,
                            "delivered": r.delivered,
                            "expected": r.expected,
                            "errors": r.errors,
                            "events_per_s": r.events_per_s,
                            "lat_ms": r.lat_ms,
                            "first_of_tick_ms": r.first_ms,
                            "cpu_pct": r.cpu,
                            "runq_ms_per_s": r.runq,
                        }
                        for r in results
                    ],
                    "resume_ms": rs,
                    "resume_errors": out["resume_errors"],
                },
                indent=1,
            )
        )
    if args.out:
        write_result(Path(args.out), report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
