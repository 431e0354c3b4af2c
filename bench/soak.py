"""Soak: steady mixed traffic with random disconnects and cancels; nothing may leak or be lost.

Starts the processes ``tokenrelay serve`` starts (redis-server with AOF, one
engine worker, one gateway), then for ``--seconds`` runs ``--clients``
concurrent client loops. Each loop starts a stream (WebSocket, or HTTP SSE one
time in eight) and then, at random: reads it to the end, cancels it after a
few tokens, or drops the connection (a clean close or an abrupt TCP cut) and
resumes after a pause, possibly more than once. For every stream:

* the token seqs the client got are exactly 1..n (no gap, no duplicate);
* its text equals a full replay of the stream log (``resume`` with ``after: 0``).

Every ``--sample`` seconds the RSS and open file descriptors of the gateway,
the worker and redis-server are sampled. After the warm-up (the first quarter,
at least 20 s) they must stay flat: the last quarter's peak within the
tolerance of the first post-warm-up samples. At the end, with no traffic, the
worker's ``blocks_free`` must equal ``blocks_total`` (no leaked KV blocks).

    .venv/bin/python -m bench.soak                  # 3-minute smoke (run by the tests)
    .venv/bin/python -m bench.soak --seconds 1800   # 30 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.gateway.procs import Client, start_gateway, start_worker, wait_ready
from tokenrelay.core.redis.embedded import EmbeddedRedis

PREFIX = "soak:"
WORDS = ["river", "owl", "bread", "Mars", "chess", "tea", "glass", "map", "snow", "bee"]
TOLERANCE_KIB = {"gateway": 25_000, "worker": 150_000, "redis": 25_000}
TOLERANCE_FDS = 12


@dataclass
class Stats:
    streams: int = 0
    completed: int = 0
    cancelled: int = 0
    drops: int = 0
    resumes: int = 0
    sse: int = 0
    tokens: int = 0
    lost: int = 0
    refused: int = 0
    problems: list[str] = field(default_factory=list)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Seen:
    """One stream as its client saw it."""

    def __init__(self) -> None:
        self.sid = self.token = ""
        self.seqs: list[int] = []
        self.text: list[str] = []
        self.done: dict[str, Any] | None = None

    def take(self, f: dict[str, Any]) -> None:
        if f["type"] == "token":
            self.seqs.append(f["seq"])
            self.text.append(f["text"])
        elif f["type"] == "done":
            self.done = f


async def ws_stream(addr: str, rng: random.Random, st: Stats) -> Seen | None:
    s = Seen()
    c = await Client.open(addr)
    content = f"Write about {rng.choice(WORDS)} and {rng.choice(WORDS)}."
    params = {"max_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.8]),
              "seed": rng.randrange(1000), "ignore_eos": rng.random() < 0.5}  # fmt: skip
    await c.send({"type": "generate", "messages": [{"role": "user", "content": content}],
                  "params": params})  # fmt: skip
    while not s.sid:
        f = await c.recv(120)
        if f["type"] == "started":
            s.sid, s.token = f["stream_id"], f["resume_token"]
        elif f["type"] == "error":
            st.refused += 1  # overloaded / unavailable: typed, allowed
            await c.close()
            return None
    action = rng.random()
    drops = rng.randint(1, 2) if action < 0.35 else 0
    cancel_at = rng.randint(1, 4) if 0.35 <= action < 0.55 else None
    while s.done is None:
        budget = rng.randint(0, 6) if drops else 10**9
        while s.done is None and budget > 0:
            f = await c.recv(120)
            s.take(f)
            if f["type"] == "token":
                budget -= 1
                if cancel_at is not None and len(s.seqs) >= cancel_at:
                    await c.send({"type": "cancel", "stream_id": s.sid})
                    cancel_at = None
            elif f["type"] == "error":
                raise AssertionError(f)
        if s.done is not None:
            break
        drops -= 1
        st.drops += 1
        if rng.random() < 0.5:
            await c.close()
        else:
            c.cut()
        await asyncio.sleep(rng.uniform(0, 1.0))
        c = await Client.open(addr)
        st.resumes += 1
        after = s.seqs[-1] if s.seqs else 0
        await c.send({"type": "resume", "stream_id": s.sid, "resume_token": s.token,
                      "after": after})  # fmt: skip
    await c.close()
    return s


async def sse_stream(addr: str, rng: random.Random, st: Stats) -> Seen | None:
    s = Seen()
    body = {"messages": [{"role": "user", "content": f"Name a {rng.choice(WORDS)}."}],
            "max_tokens": rng.randint(2, 12), "stream": True}  # fmt: skip
    async with (
        httpx.AsyncClient(timeout=120) as http,
        http.stream("POST", f"http://{addr}/v1/chat/completions", json=body) as r,
    ):
        if r.status_code != 200:
            st.refused += 1
            return None
        s.sid, s.token = r.headers["x-stream-id"], r.headers["x-resume-token"]
        async for line in r.aiter_lines():
            if line.startswith("id: "):
                s.seqs.append(int(line[4:]))
    st.sse += 1
    return s


async def replay(addr: str, s: Seen) -> tuple[list[int], str, dict[str, Any]]:
    c = await Client.open(addr)
    await c.send({"type": "resume", "stream_id": s.sid, "resume_token": s.token, "after": 0})
    frames = await c.recv_until(lambda f: f["type"] in ("done", "error"), 60)
    await c.close()
    seqs = [f["seq"] for f in frames if f["type"] == "token"]
    return seqs, "".join(f["text"] for f in frames if f["type"] == "token"), frames[-1]


async def client_loop(addr: str, seed: int, until: float, st: Stats) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        sse = rng.random() < 0.125
        s = await (sse_stream if sse else ws_stream)(addr, rng, st)
        if s is None:
            await asyncio.sleep(0.5)
            continue
        st.streams += 1
        seqs, text, done = await replay(addr, s)
        if done["type"] != "done":
            st.lost += 1
            st.problems.append(f"{s.sid}: replay ended with {done}")
            continue
        if sse:  # SSE ids: 0 (the role chunk), every token's seq, then the done's
            ok = s.seqs == list(range(0, done["seq"] + 1)) and seqs == list(range(1, done["seq"]))
            got_text = text
        else:
            assert s.done is not None
            expected = list(range(1, s.done["seq"]))
            ok = s.seqs == expected and seqs == expected
            got_text = "".join(s.text)
            if s.done["finish_reason"] == "cancelled":
                st.cancelled += 1
        if not ok or got_text != text:
            st.lost += 1
            st.problems.append(f"{s.sid}: seqs {s.seqs[:8]}.. vs log {seqs[:8]}..")
        else:
            st.completed += 1
            st.tokens += len(seqs)


async def sampler(pids: dict[str, int], every: float, until: float, out: list[dict]) -> None:
    start = time.monotonic()
    while time.monotonic() < until:
        row: dict[str, Any] = {"t": round(time.monotonic() - start, 1)}
        for name, pid in pids.items():
            row[f"{name}_rss_kib"] = rss_kib(pid)
            row[f"{name}_fds"] = fds(pid)
        out.append(row)
        await asyncio.sleep(every)


def flatness(samples: list[dict], names: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Growth after warm-up per process; problems where over the tolerance."""
    n = len(samples)
    warm = max(1, n // 4)
    base, late = samples[warm : warm + max(1, n // 8)], samples[-max(1, n // 4) :]
    report: dict[str, Any] = {}
    problems = []
    for name in names:
        b_rss = statistics.median(s[f"{name}_rss_kib"] for s in base)
        l_rss = max(s[f"{name}_rss_kib"] for s in late)
        b_fd = max(s[f"{name}_fds"] for s in base)
        l_fd = samples[-1][f"{name}_fds"]
        report[name] = {"rss_mib_after_warmup": round(b_rss / 1024, 1),
                        "rss_mib_peak_late": round(l_rss / 1024, 1),
                        "fds_after_warmup": b_fd, "fds_end": l_fd}  # fmt: skip
        if l_rss - b_rss > TOLERANCE_KIB[name]:
            problems.append(f"{name} RSS grew {(l_rss - b_rss) / 1024:.1f} MiB after warm-up")
        if l_fd - b_fd > TOLERANCE_FDS:
            problems.append(f"{name} open fds grew from {b_fd} to {l_fd}")
    return report, problems


def worker_blocks(redis: EmbeddedRedis, worker_id: str) -> dict[str, Any]:
    raw = redis.client().hget(f"{PREFIX}w:{worker_id}", "stats")
    return dict(json.loads(raw)) if raw else {}


async def soak(seconds: float, clients: int, every: float, workdir: Path) -> dict[str, Any]:
    redis = EmbeddedRedis(workdir / "redis").start()
    # the KV pool resident from the start: a lazily touched pool grows the RSS as its blocks
    # are first used, which is not a leak (engine/runner/kv_cache.py)
    worker = start_worker(redis.url, PREFIX, workdir, "--worker-id", "soak-worker",
                          "--max-num-seqs", "16", "--detach-timeout", "20",
                          env={"TOKENRELAY_KV_LAZY": "0"})  # fmt: skip
    gw, addr = start_gateway(redis.url, PREFIX, workdir, "--max-pending", "64")
    st, samples = Stats(), []  # type: ignore[var-annotated]
    try:
        await asyncio.to_thread(wait_ready, addr, gw, 600)
        assert redis.proc is not None
        pids = {"gateway": gw.pid, "worker": worker.pid, "redis": redis.proc.pid}
        started = time.monotonic()
        until = started + seconds
        sample_task = asyncio.create_task(sampler(pids, every, until + every, samples))
        await asyncio.gather(*(client_loop(addr, 1000 + i, until, st) for i in range(clients)))
        await sample_task
        elapsed = time.monotonic() - started
        deadline = time.monotonic() + 60  # detached streams end within --detach-timeout
        blocks: dict[str, Any] = {}
        while time.monotonic() < deadline:
            blocks = worker_blocks(redis, "soak-worker")
            if blocks.get("blocks_free") == blocks.get("blocks_total") and not blocks.get(
                "active_streams"
            ):
                break
            await asyncio.sleep(1.0)
        report, problems = flatness(samples, list(pids))
        leaked = int(blocks.get("blocks_total", 0)) - int(blocks.get("blocks_free", -1))
        if leaked:
            problems.append(f"{leaked} KV blocks not freed: {blocks}")
        logs = gw.log_text() + worker.log_text()
        if "Traceback" in logs:
            problems.append("a traceback in the gateway or worker log")
        problems += st.problems[:20]
        if st.lost:
            problems.append(f"{st.lost} streams lost tokens")
        return {"seconds": round(elapsed, 1), "clients": clients, **asdict(st),
                "problems": problems, "processes": report, "leaked_blocks": leaked,
                "blocks_total": blocks.get("blocks_total"), "samples": samples}  # fmt: skip
    finally:
        gw.stop()
        worker.stop()
        redis.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--seconds", type=float, default=180.0, help="traffic duration (180: smoke)")
    ap.add_argument("--clients", type=int, default=6, help="concurrent client loops")
    ap.add_argument("--sample", type=float, default=5.0, help="seconds between RSS/fd samples")
    ap.add_argument("--json", type=Path, help="write the full result here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tokenrelay-soak-") as tmp:
        result = asyncio.run(soak(args.seconds, args.clients, args.sample, Path(tmp)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    keys = ("seconds", "streams", "completed", "cancelled", "drops", "resumes", "sse", "tokens",
            "lost", "refused", "leaked_blocks", "blocks_total")  # fmt: skip
    for k in keys:
        print(f"{k:>14}: {result[k]}")
    for name, figures in result["processes"].items():
        print(f"{name:>14}: {figures}")
    for p in result["problems"]:
        print(f"PROBLEM: {p}")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
