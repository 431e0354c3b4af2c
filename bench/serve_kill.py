"""Worker kill under ``tokenrelay serve`` alone: restart + model load + prefill, as clients see it.

Starts ``tokenrelay serve`` (default model, CPU, its own data dir and port,
``HF_HUB_OFFLINE=1``), runs ``--streams`` greedy WebSocket streams once
uninterrupted (the reference texts), then starts them again and SIGKILLs serve's
one engine worker once every stream has ``--kill-after`` tokens. No other worker
exists: serve notices the exit, starts a new worker after its restart delay
(core/serve.py, 1 s), which loads the model, claims the dead worker's streams
once its heartbeat has expired and continues them from the stream log
(worker/continuation.py). Reported:

* the timeline after the SIGKILL: serve's log line on the exit, the new worker's
  pid (seen in /proc) and its ``loading model`` / ``worker ready`` log lines,
  the old heartbeat key gone and the new one there (Redis), each stream's owner
  changing (the takeover) and its first token after that (the client);
* the longest pause each client saw between two tokens (p50/p99/max);
* for every stream: finished ``length``, seqs 1..n with no gap or duplicate, the
  text equal to the uninterrupted reference and to a replay of the stream log;
* the machine and its load average.

    .venv/bin/python -m bench.serve_kill                # prints the tables
    .venv/bin/python -m bench.serve_kill --streams 8 --tokens 48 --kill-after 8
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench.common import load_average, machine, result_path, say, write_result
from bench.faults import Got, finish, percentile, read, replay, start
from tests.core.test_serve import children, cmdline
from tests.gateway.procs import Proc, free_port, wait_ready
from tokenrelay.core.wire.keys import DEFAULT_PREFIX, Keys

# serve's and the worker's log lines (both write to serve's output) -> timeline step
LOG_STEPS = {
    "engine worker exited; restarting": "exit",
    "engine worker started": "spawned",
    "loading model": "loading",
    "worker ready": "ready",
    "request continued": "continued",
}


def log_events(text: str, since: float) -> dict[str, list[float]]:
    """Seconds after ``since`` (wall clock) of the :data:`LOG_STEPS` lines in a JSON log.

    Lines that are not JSON (a library printing on its own) and lines from before
    ``since`` are skipped; each step's times are in log order.
    """
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        step = LOG_STEPS.get(str(rec.get("msg", "")))
        ts = rec.get("ts")
        if step is None or not isinstance(ts, (int, float)) or ts < since:
            continue
        out.setdefault(step, []).append(round(ts - since, 3))
    return out


def longest_pause(times: list[float]) -> float:
    """The longest gap between two consecutive token arrivals; 0 for fewer than two."""
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


@dataclass
class Watch:
    """What the watcher saw after the kill, in seconds after it (monotonic)."""

    new_pid: float | None = None
    old_beat_gone: float | None = None
    new_beat: float | None = None
    taken: dict[int, float] = field(default_factory=dict)  # stream -> owner changed


def owner(r: redis.Redis, keys: Keys, sid: str) -> str:
    """The worker id in a stream's metadata (``w``), or ""."""
    raw = r.hget(keys.meta(sid), "w")
    return raw.decode() if isinstance(raw, bytes) else str(raw or "")


def worker_pids(serve_pid: int) -> list[int]:
    return [k for k in children(serve_pid) if "redis-server" not in cmdline(k)]


async def watch(
    r: redis.Redis, keys: Keys, serve_pid: int, old: tuple[int, str], gots: list[Got],
    killed: float, w: Watch, limit: float = 300.0,
) -> None:  # fmt: skip
    """Poll /proc and Redis until every stream has a new owner (or ``limit`` seconds)."""
    old_pid, old_id = old
    old_key = keys.worker(old_id)
    while len(w.taken) < len(gots) and time.monotonic() - killed < limit:
        now = time.monotonic() - killed
        if w.new_pid is None and [p for p in worker_pids(serve_pid) if p != old_pid]:
            w.new_pid = now
        if w.old_beat_gone is None and not r.exists(old_key):
            w.old_beat_gone = now
        if w.new_beat is None:
            beats = [k for k in r.scan_iter(match=f"{keys.prefix}w:*") if k.decode() != old_key]
            if beats:
                w.new_beat = now
        for g in gots:
            if g.i not in w.taken and owner(r, keys, g.sid) != old_id:
                w.taken[g.i] = now
        await asyncio.sleep(0.02)


@dataclass
class Result:
    streams: int = 0
    length: int = 0
    gapless: int = 0
    same_text: int = 0
    same_log: int = 0
    frames: int = 0  # token frames: one may carry several tokens (held-back text)
    tokens: int = 0  # completion tokens, from each `done`'s usage
    pauses: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)  # takeover -> next token
    first_after: list[float] = field(default_factory=list)  # kill -> next token
    steps: dict[str, list[float]] = field(default_factory=dict)  # from the log
    watch: Watch = field(default_factory=Watch)
    cold_load: float | None = None  # serve's first worker: loading model -> worker ready
    load: str = ""
    problems: list[str] = field(default_factory=list)


async def streams_once(addr: str, n: int, params: dict[str, Any]) -> list[Got]:
    gots = [Got(i) for i in range(n)]
    clients = [await start(addr, g, params) for g in gots]
    await asyncio.gather(*(read(c, g) for c, g in zip(clients, gots, strict=True)))
    for c in clients:
        await c.close()
    return gots


async def run(n: int, tokens: int, kill_after: int, device: str, workdir: Path) -> Result:
    port = free_port()
    args = ["serve", "--port", str(port), "--device", device, "--data-dir", str(workdir / "r")]
    serve = Proc(args, workdir / "serve.log")
    addr, res = f"127.0.0.1:{port}", Result()
    params = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    try:
        started = time.time()
        await asyncio.to_thread(wait_ready, addr, serve, 600)
        first = log_events(serve.log_text(), started)
        if first.get("loading") and first.get("ready"):
            res.cold_load = round(first["ready"][0] - first["loading"][0], 3)
        url = next(
            json.loads(line)["redis"]
            for line in serve.log_text().splitlines()
            if line.startswith("{") and json.loads(line).get("msg") == "serving"
        )
        r, keys = redis.Redis.from_url(url), Keys(DEFAULT_PREFIX)
        say(f"serve ready on {addr} ({time.time() - started:.1f} s); reference run")
        refs = {g.i: "".join(g.text) for g in await streams_once(addr, n, params)}

        gots = [Got(i) for i in range(n)]
        clients = [await start(addr, g, params) for g in gots]
        await asyncio.gather(*(read(c, g, kill_after) for c, g in zip(clients, gots, strict=True)))
        (pid,) = worker_pids(serve.pid)
        owners = {owner(r, keys, g.sid) for g in gots}
        if len(owners) != 1:
            res.problems.append(f"streams owned by {sorted(owners)}, expected one worker")
        old_id = sorted(owners)[0]
        os.kill(pid, signal.SIGKILL)
        killed, killed_wall = time.monotonic(), time.time()
        say(f"SIGKILL worker {pid} ({old_id}) with {n} streams at {kill_after} tokens each")
        watcher = asyncio.create_task(
            watch(r, keys, serve.pid, (pid, old_id), gots, killed, res.watch)
        )
        await asyncio.gather(*(finish(c, g, addr, 300) for c, g in zip(clients, gots, strict=True)))
        await watcher
        res.steps = log_events(serve.log_text(), killed_wall)
        res.load = load_average()

        for g in gots:
            res.streams += 1
            done = g.done or {}
            res.frames += len(g.seqs)
            res.tokens += int((done.get("usage") or {}).get("completion_tokens", 0))
            res.length += done.get("finish_reason") == "length"
            gapless = g.seqs == list(range(1, int(done.get("seq", 0))))
            res.gapless += gapless
            text = "".join(g.text)
            res.same_text += text == refs[g.i]
            res.same_log += await replay(addr, g) == text
            if not gapless or text != refs[g.i] or done.get("finish_reason") != "length":
                res.problems.append(f"stream {g.i}: ended {done.get('finish_reason')}, "
                                    f"seqs {g.seqs[:3]}..{g.seqs[-3:]}")  # fmt: skip
            res.pauses.append(longest_pause(g.times))
            taken = res.watch.taken.get(g.i)
            after = [t - killed for t in g.times if taken is not None and t - killed > taken]
            if taken is not None and after:
                res.first_token.append(after[0] - taken)
                res.first_after.append(after[0])
        r.close()
    finally:
        if serve.alive():
            serve.signal(signal.SIGTERM)
        serve.stop(60)
    return res


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def first(values: list[float] | None) -> float | None:
    return values[0] if values else None


def spread(values: list[float]) -> str:
    """``p50 / max`` of ``values`` (seconds), or - for none."""
    if not values:
        return "-"
    s = sorted(values)
    return f"{percentile(s, 50):.2f} / {s[-1]:.2f}"


def report(res: Result, n: int, tokens: int, kill_after: int) -> str:
    w, steps = res.watch, res.steps
    taken, pauses = list(w.taken.values()), sorted(res.pauses)
    rows = [
        ("serve logs the exit (`engine worker exited; restarting`)", fmt(first(steps.get("exit")))),
        ("serve starts a new worker (`engine worker started`)", fmt(first(steps.get("spawned")))),
        ("new worker pid seen in /proc", fmt(w.new_pid)),
        ("new worker begins loading the model (`loading model`)", fmt(first(steps.get("loading")))),
        ("old worker's heartbeat key expired", fmt(w.old_beat_gone)),
        ("new worker ready, model loaded (`worker ready`)", fmt(first(steps.get("ready")))),
        ("new worker's first heartbeat", fmt(w.new_beat)),
        ("streams taken over (owner changed), p50 / max", spread(taken)),
        ("first token after the takeover, p50 / max", spread(res.first_after)),
    ]
    lines = [
        f"`python -m bench.serve_kill --streams {n} --tokens {tokens} --kill-after {kill_after}`, "
        f"{time.strftime('%Y-%m-%d')}, {machine()}",
        "",
        "| after the SIGKILL | s |",
        "| --- | ---: |",
        *(f"| {a} | {b} |" for a, b in rows),
        "",
        "| streams | finished `length` | seqs gapless | text = reference | text = log "
        "| longest pause p50 | p99 | max | load average (1/5/15 min) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        f"| {res.streams} | {res.length} | {res.gapless} | {res.same_text} | {res.same_log} "
        f"| {percentile(pauses, 50):.2f} s | {percentile(pauses, 99):.2f} s "
        f"| {max(pauses, default=0):.2f} s | {res.load} |",
        "",
        f"- first token after the takeover (prefill of prompt and tokens so far, one step), "
        f"p50 / max: {spread(res.first_token)} s",
        f"- model load of serve's first worker (cold start, `loading model` to `worker ready`): "
        f"{fmt(res.cold_load)} s; after the kill: "
        f"{fmt(_diff(first(steps.get('loading')), first(steps.get('ready'))))} s",
        f"- completion tokens: {res.tokens} in {res.frames} token frames; "
        f"`request continued` log lines: {len(steps.get('continued', []))}",
    ]
    lines += [f"- problem: {p}" for p in res.problems]
    return "\n".join(lines)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def ok(res: Result) -> bool:
    n = res.streams
    return bool(n) and res.length == res.gapless == res.same_text == res.same_log == n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.serve_kill",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams")
    ap.add_argument("--tokens", type=int, default=48, help="max_tokens of each stream")
    ap.add_argument("--kill-after", type=int, default=8, help="tokens every stream has at the kill")
    ap.add_argument("--device", default="cpu", help="serve's --device")
    ap.add_argument("--out", nargs="?", const=result_path("serve_kill.md"), type=Path,
                    help="also save the report (default bench/results/serve_kill.md)")  # fmt: skip
    a = ap.parse_args(argv)
    if not 0 < a.kill_after < a.tokens:
        ap.error("--kill-after must be between 1 and --tokens - 1")
    with tempfile.TemporaryDirectory(prefix="tokenrelay-serve-kill-") as tmp:
        res = asyncio.run(run(a.streams, a.tokens, a.kill_after, a.device, Path(tmp)))
    text = report(res, a.streams, a.tokens, a.kill_after)
    print(text)
    if a.out:
        write_result(a.out, text)
    return 0 if ok(res) else 1


if __name__ == "__main__":
    sys.exit(main())
