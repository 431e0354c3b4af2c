"""Fault injection against a real stack: what is lost when things break? (Nothing.)

Starts its own redis-server (AOF), two engine workers, two gateways and a TCP
proxy in front of gateway B, then injects, one case at a time:

* net-cut      the proxy severs every client connection mid-stream; clients
               reconnect through it and resume from their last seq;
* gateway-kill SIGKILL of gateway A mid-stream; its clients resume on gateway B;
* redis-kill   SIGKILL of redis-server mid-stream, restarted on its AOF;
               clients resume; every event a client had seen is still in the log;
* worker-kill  SIGKILL of the engine worker with the most streams once each
               has a few tokens: the other worker takes them over and continues
               them (every stream completes with the uninterrupted text); the row
               also reports the longest pause a client saw (p50/p99), the time to
               notice the death and from the takeover to the next token;
* takeover     requests read by a worker that dies before starting them
               (a consumer that never heartbeats) are claimed by the live
               worker and completed.

For every stream: seqs contiguous from 1 (no gap, no duplicate), the text
equal to the uninterrupted greedy text for its prompt, and equal to a replay of
the stream log. ``lost`` counts missing or wrong tokens and must be 0.

    .venv/bin/python -m bench.faults               # prints the table
    .venv/bin/python -m bench.faults --streams 8   # more streams per case
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.netproxy import TcpProxy
from tests.gateway.procs import Client, start_gateway, start_worker, wait_ready
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.keys import Keys
from tokenrelay.worker.store import WorkerStore

PREFIX = "flt:"
TOPICS = ["rivers", "owls", "bread", "Mars", "chess", "tea", "glass", "maps"]


def prompt(i: int) -> str:
    return f"Tell me a short fact about {TOPICS[i % len(TOPICS)]}."


@dataclass
class Row:
    """One case of the table."""

    case: str
    faults: int
    streams: int
    tokens: int
    lost: int
    ended_error: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)  # the worker-kill row's timings


@dataclass
class Got:
    """What one client saw of its stream."""

    i: int
    sid: str = ""
    token: str = ""
    seqs: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    done: dict[str, Any] | None = None
    reconnects: int = 0
    times: list[float] = field(default_factory=list)  # when each token frame came

    @property
    def after(self) -> int:
        return self.seqs[-1] if self.seqs else 0


class Stack:
    """redis-server, two workers, two gateways, a proxy in front of gateway B."""

    def __init__(self, workdir: Path, tokens: int) -> None:
        self.dir = workdir
        self.tokens = tokens
        self.redis = EmbeddedRedis(workdir / "redis").start()
        url = self.redis.url
        self.workers = {
            w: start_worker(url, PREFIX, workdir, "--worker-id", w, "--detach-timeout", "60")
            for w in ("w1", "w2")
        }
        self.gw_a, self.a = start_gateway(url, PREFIX, workdir)
        self.gw_b, self.b = start_gateway(url, PREFIX, workdir)
        self.proxy: TcpProxy | None = None
        self.refs: dict[int, str] = {}

    def wait(self) -> None:
        wait_ready(self.a, self.gw_a, 600)
        wait_ready(self.b, self.gw_b, 60)
        deadline = time.monotonic() + 600
        while len(self.live_workers()) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("workers did not come up")
            time.sleep(0.5)

    def live_workers(self) -> list[str]:
        r = self.redis.client()
        return [w for w in ("w1", "w2") if r.exists(f"{PREFIX}w:{w}")]

    def params(self, tokens: int | None = None) -> dict[str, Any]:
        return {"max_tokens": tokens or self.tokens, "temperature": 0, "ignore_eos": True}

    def stop(self) -> None:
        for p in [self.gw_a, self.gw_b, *self.workers.values()]:
            p.stop()
        self.redis.cleanup()


async def start(addr: str, got: Got, params: dict[str, Any]) -> Client:
    c = await Client.open(addr)
    messages = [{"role": "user", "content": prompt(got.i)}]
    await c.send({"type": "generate", "request_id": f"f{got.i}", "messages": messages,
                  "params": params})  # fmt: skip
    while True:
        f = await c.recv(120)
        if f["type"] == "started":
            got.sid, got.token = f["stream_id"], f["resume_token"]
            return c
        if f["type"] == "error":
            raise RuntimeError(f)


async def read(
    c: Client, got: Got, until_tokens: int | None = None, *, resuming: bool = False
) -> str:
    """Read into ``got``: 'done', 'enough' (``until_tokens`` seen), 'broken' or 'unavailable'.

    ``resuming``: a ``resume`` was just sent on this socket; frames an earlier
    tail had already queued come before its ``resumed`` and are skipped (the
    replay after ``resumed`` starts right after ``got.after``).
    """
    try:
        while True:
            if until_tokens is not None and len(got.seqs) >= until_tokens:
                return "enough"
            f = await c.recv(120)
            if resuming and f["type"] in ("token", "done"):
                continue
            if f["type"] == "resumed":
                resuming = False
            elif f["type"] == "token":
                got.seqs.append(f["seq"])
                got.text.append(f["text"])
                got.times.append(time.monotonic())
            elif f["type"] == "done":
                got.done = f
                return "done"
            elif f["type"] == "error":
                if f.get("code") == "unavailable":
                    return "unavailable"
                raise RuntimeError(f)
    except (TimeoutError, OSError, EOFError):
        return "broken"
    except Exception as exc:
        if type(exc).__name__.startswith("ConnectionClosed"):
            return "broken"
        raise


async def finish(c: Client | None, got: Got, addr: str, deadline: float = 120.0) -> None:
    """Read to the end, reconnecting to ``addr`` and resuming whenever the link breaks."""
    end = time.monotonic() + deadline
    if c is not None:  # read on while the socket lasts
        outcome = await read(c, got)
        if outcome == "done":
            await c.close()
            return
        if outcome == "broken":
            c = None
    while time.monotonic() < end:
        if c is None:
            try:
                c = await Client.open(addr)
            except Exception:
                await asyncio.sleep(0.3)
                continue
            got.reconnects += 1
        await c.send({"type": "resume", "stream_id": got.sid, "resume_token": got.token,
                      "after": got.after})  # fmt: skip
        outcome = await read(c, got, resuming=True)
        if outcome == "done":
            await c.close()
            return
        if outcome == "broken":
            c = None
        await asyncio.sleep(0.3)
    raise TimeoutError(f"stream {got.i} did not finish")


async def replay(addr: str, got: Got) -> str:
    c = await Client.open(addr)
    await c.send({"type": "resume", "stream_id": got.sid, "resume_token": got.token, "after": 0})
    frames = await c.recv_until(lambda f: f["type"] in ("done", "error"), 60)
    await c.close()
    return "".join(f["text"] for f in frames if f["type"] == "token")


async def check(stack: Stack, row: Row, gots: list[Got], *, complete: bool = True) -> None:
    """Count lost tokens: gaps, duplicates, text unlike the reference or the log.

    ``complete=False`` (streams longer than the reference, some cut short):
    the text and the reference must agree up to the shorter of the two.
    """
    for g in gots:
        row.streams += 1
        row.tokens += len(g.seqs)
        assert g.done is not None
        if g.seqs != list(range(1, g.done["seq"])):
            row.lost += max(1, abs(g.done["seq"] - 1 - len(set(g.seqs))))
            row.problems.append(f"stream {g.i}: seqs {g.seqs[:5]}... done {g.done['seq']}")
        text, ref = "".join(g.text), stack.refs.get(g.i)
        if g.done["finish_reason"] == "error":
            row.ended_error += 1
        agree = (
            text == ref if complete else (ref or "").startswith(text) or text.startswith(ref or "")
        )
        if ref is not None and not agree:
            row.lost += 1
            row.problems.append(f"stream {g.i}: text differs from the reference")
        if await replay(stack.b, g) != text:
            row.lost += 1
            row.problems.append(f"stream {g.i}: text differs from the stream log")


async def references(stack: Stack, n: int) -> None:
    gots = [Got(i) for i in range(n)]
    clients = [await start(stack.b, g, stack.params()) for g in gots]
    for c, g in zip(clients, gots, strict=True):
        await read(c, g)
        await c.close()
        stack.refs[g.i] = "".join(g.text)


async def case_net_cut(stack: Stack, n: int) -> Row:
    row = Row("net-cut (proxy severs client links)", 0, 0, 0, 0)
    assert stack.proxy is not None
    gots = [Got(i) for i in range(n)]
    clients = [await start(stack.proxy.addr, g, stack.params()) for g in gots]
    await asyncio.gather(*(read(c, g, 3) for c, g in zip(clients, gots, strict=True)))
    row.faults = stack.proxy.sever()
    await asyncio.gather(*(finish(None, g, stack.proxy.addr) for g in gots))
    await check(stack, row, gots)
    return row


async def case_gateway_kill(stack: Stack, n: int) -> Row:
    row = Row("gateway-kill (SIGKILL gateway A)", 1, 0, 0, 0)
    gots = [Got(i) for i in range(n)]
    clients = [await start(stack.a, g, stack.params()) for g in gots]
    await asyncio.gather(*(read(c, g, 3) for c, g in zip(clients, gots, strict=True)))
    stack.gw_a.signal(signal.SIGKILL)
    await asyncio.gather(*(finish(c, g, stack.b) for c, g in zip(clients, gots, strict=True)))
    await check(stack, row, gots)
    stack.gw_a.stop()
    stack.gw_a, stack.a = start_gateway(stack.redis.url, PREFIX, stack.dir)
    await asyncio.to_thread(wait_ready, stack.a, stack.gw_a, 60)
    return row


async def case_redis_kill(stack: Stack, n: int) -> Row:
    row = Row("redis-kill (SIGKILL, restart on AOF)", 1, 0, 0, 0)
    gots = [Got(i) for i in range(n)]
    clients = [await start(stack.a, g, stack.params()) for g in gots]
    await asyncio.gather(*(read(c, g, 3) for c, g in zip(clients, gots, strict=True)))
    seen = {g.i: list(g.text) for g in gots}
    stack.redis.kill()
    await asyncio.sleep(1.0)
    stack.redis.start()
    await asyncio.gather(*(finish(c, g, stack.a) for c, g in zip(clients, gots, strict=True)))
    await check(stack, row, gots)
    for g in gots:  # acknowledged = seen by a client: still in the log, unchanged
        if "".join(g.text[: len(seen[g.i])]) != "".join(seen[g.i]):
            row.lost += 1
            row.problems.append(f"stream {g.i}: events seen before the kill changed")
    return row


async def case_worker_kill(stack: Stack, n: int) -> Row:
    """SIGKILL the worker with the most streams once each has a few tokens: the live
    worker takes its streams over and continues them (worker/continuation.py)."""
    row = Row("worker-kill (SIGKILL a worker)", 1, 0, 0, 0)
    gots = [Got(i) for i in range(n)]
    clients = [await start(stack.a, g, stack.params()) for g in gots]
    before = max(1, min(8, stack.tokens // 2))  # tokens each stream has at the kill
    await asyncio.gather(*(read(c, g, before) for c, g in zip(clients, gots, strict=True)))
    r = stack.redis.client()
    meta = Keys(PREFIX).meta
    owner = {g.i: (r.hget(meta(g.sid), "w") or b"").decode() for g in gots}
    victim = max(("w1", "w2"), key=lambda w: sum(o == w for o in owner.values()))
    moved = [g for g in gots if owner[g.i] == victim]
    stack.workers[victim].signal(signal.SIGKILL)
    killed = time.monotonic()
    taken: dict[int, float] = {}

    async def watch() -> None:  # when each of the victim's streams gets its new owner
        while len(taken) < len(moved) and time.monotonic() - killed < 60:
            for g in moved:
                if g.i not in taken and (r.hget(meta(g.sid), "w") or b"").decode() != victim:
                    taken[g.i] = time.monotonic()
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    await asyncio.gather(*(finish(c, g, stack.a) for c, g in zip(clients, gots, strict=True)))
    await watcher
    await check(stack, row, gots)
    for g in gots:
        if g.done is None or g.done["finish_reason"] != "length":
            row.lost += 1
            row.problems.append(
                f"stream {g.i} on {owner[g.i]}: ended {g.done and g.done['finish_reason']}"
            )
    pauses = sorted(
        max(b - a for a, b in itertools.pairwise(g.times)) for g in moved if len(g.times) > 1
    )
    prefill = sorted(
        next(t for t in g.times if t > taken[g.i]) - taken[g.i]
        for g in moved
        if g.i in taken and any(t > taken[g.i] for t in g.times)
    )
    row.stats = {
        "continued": len(moved),
        "pause_p50_s": percentile(pauses, 50),
        "pause_p99_s": percentile(pauses, 99),
        "detect_s": percentile(sorted(t - killed for t in taken.values()), 50),
        "takeover_to_token_p50_s": percentile(prefill, 50),
        "takeover_to_token_p99_s": percentile(prefill, 99),
    }
    row.problems.append(f"killed {victim}: {len(moved)} streams continued on the other worker")
    stack.workers.pop(victim).stop()
    return row


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of sorted ``values``; 0 for none."""
    if not values:
        return 0.0
    return round(values[min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))], 3)


async def case_takeover(stack: Stack, n: int) -> Row:
    """Requests read by a consumer that died before starting them are claimed and run."""
    row = Row("takeover (dead consumer's requests)", 1, 0, 0, 0)
    live = next(iter(stack.workers.values()))
    # a consumer of the queue the live worker reads: its model's (the default model)
    ghost = WorkerStore(stack.redis.url, "ghost", prefix=PREFIX, models=["default"])
    ghost.ensure_group()
    gots = [Got(i) for i in range(n)]
    live.signal(signal.SIGSTOP)  # so that the ghost, not the live worker, reads them
    try:
        clients = []
        for g in gots:
            c = await Client.open(stack.a)
            await c.send({"type": "generate", "request_id": f"t{g.i}", "params": stack.params(),
                          "messages": [{"role": "user", "content": prompt(g.i)}]})  # fmt: skip
            clients.append(c)
        taken: list[Any] = []
        deadline = time.monotonic() + 3.0
        while len(taken) < n and time.monotonic() < deadline:  # the gateway may still be queueing
            taken += await asyncio.to_thread(ghost.read_requests, 100, None)
            await asyncio.sleep(0.05)
    finally:
        live.signal(signal.SIGCONT)
        ghost.close()
    if len(taken) != n:
        row.problems.append(f"the dead consumer read {len(taken)} of {n}")
    for c, g in zip(clients, gots, strict=True):
        while not g.sid:
            f = await c.recv(60)
            if f["type"] == "started":
                g.sid, g.token = f["stream_id"], f["resume_token"]
            elif f["type"] == "error":
                raise RuntimeError(f)
        await read(c, g)
        await c.close()
    await check(stack, row, gots)
    return row


CASES = [case_net_cut, case_gateway_kill, case_redis_kill, case_worker_kill, case_takeover]


async def run(streams: int, tokens: int, workdir: Path) -> list[Row]:
    stack = Stack(workdir, tokens)
    rows: list[Row] = []
    try:
        await asyncio.to_thread(stack.wait)
        gw_b_port = int(stack.b.rsplit(":", 1)[1])
        stack.proxy = await TcpProxy.start("127.0.0.1", gw_b_port)
        await references(stack, streams)
        for case in CASES:
            started = time.monotonic()
            row = await case(stack, streams)
            row.seconds = time.monotonic() - started
            rows.append(row)
            print(format_row(row), flush=True)
    finally:
        if stack.proxy is not None:
            await stack.proxy.close()
        stack.stop()
    return rows


HEADER = "| case | faults | streams | tokens seen | lost | ended with error | s |"


def format_row(r: Row) -> str:
    return (f"| {r.case} | {r.faults} | {r.streams} | {r.tokens} | {r.lost} | "
            f"{r.ended_error} | {r.seconds:.1f} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.faults",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--streams", type=int, default=4, help="streams per case")
    ap.add_argument("--tokens", type=int, default=24, help="max_tokens of each stream")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    print(HEADER + "\n|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory(prefix="tokenrelay-faults-") as tmp:
        rows = asyncio.run(run(args.streams, args.tokens, Path(tmp)))
    for r in rows:
        for p in r.problems:
            print(f"  {r.case}: {p}")
        if r.stats:
            print(f"  {r.case}: " + ", ".join(f"{k} {v}" for k, v in r.stats.items()))
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    lost = sum(r.lost for r in rows)
    print(f"total: {sum(r.faults for r in rows)} faults, {sum(r.streams for r in rows)} streams, "
          f"{lost} lost")  # fmt: skip
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
