"""An engine step's append to the stream logs: one Redis round trip, against redis-py's way.

Every engine step appends each running sequence's new events with
:meth:`worker.store.WorkerStore.flush`: one pipeline of ``APPEND_LUA`` calls
(core/wire/scripts.py). The pipeline queues the script as ``EVAL``
(:func:`core.redis.connection.queue_script`). The peer is what redis-py does with
a registered ``Script`` in a pipeline, what the worker did before: the same
calls as ``EVALSHA``, after a ``SCRIPT EXISTS`` round trip of their own.

For each batch size (streams appended per step), the two alternate step by step
on one embedded redis-server, each step appending one token event to every
stream, as a decode step does (``--events``: that many per stream, as an append
that carried several steps' tokens would). Reported: the step's wall time as the
worker sees it (p50 / p90), and Redis' own time per step and per token event from
``INFO commandstats``.

    .venv/bin/python -m bench.redis_append              # 1, 16, 64 and 256 streams
    .venv/bin/python -m bench.redis_append --steps 500
    .venv/bin/python -m bench.redis_append --sizes 256 --events 1 2 4 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any
from unittest import mock

from bench.common import load_average, machine
from bench.token_source import create_streams, stamp_text
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.events import token_fields
from tokenrelay.core.wire.scripts import APPEND_LUA
from tokenrelay.worker import store as workerlog
from tokenrelay.worker.store import Batch, WorkerStore

SIZES = (1, 16, 64, 256)


def redis_usec(client: Any, commands: tuple[str, ...]) -> float:
    stats = client.info("commandstats")
    return float(sum(stats.get(f"cmdstat_{c}", {}).get("usec", 0) for c in commands))


def peer_flush(store: WorkerStore, script: Any, batches: list[Batch]) -> None:
    """The former flush: ``WorkerStore.flush`` queueing a registered Script (so redis-py
    adds its SCRIPT EXISTS round trip) instead of ``EVAL``; nothing else differs."""

    def registered(pipe: Any, _text: str, keys: list[str], args: list[Any]) -> None:
        script(keys=keys, args=args, client=pipe)

    with mock.patch.object(workerlog, "queue_script", registered):
        assert all(r.status == 1 for r in store.flush(batches))


def run(url: str, size: int, steps: int, events: int = 1) -> dict[str, Any]:
    store = WorkerStore(url, "bench-append")
    script = store.redis.register_script(APPEND_LUA)
    admin = store.redis
    sids = [sid for sid, _ in create_streams(store, size, stream_ttl=600)]
    wall: dict[str, list[float]] = {"ours": [], "peer": []}
    usec: dict[str, float] = {"ours": 0.0, "peer": 0.0}
    seq = 1
    for _ in range(steps):
        for who in ("ours", "peer"):
            fields = [token_fields(stamp_text(time.time())) for _ in range(events)]
            batches = [Batch(s, seq, fields) for s in sids]
            before = redis_usec(admin, ("eval", "evalsha", "script"))
            t = time.perf_counter()
            if who == "ours":
                assert all(r.status == 1 for r in store.flush(batches))
            else:
                peer_flush(store, script, batches)
            wall[who].append(time.perf_counter() - t)
            usec[who] += redis_usec(admin, ("eval", "evalsha", "script")) - before
            seq += events
            time.sleep(0.002)  # steps are apart, as an engine's are
    store.close()
    return {"wall": wall, "usec": usec}


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * q))] * 1000


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.redis_append", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--steps", type=int, default=300, help="steps per batch size and system")
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument(
        "--events", type=int, nargs="+", default=[1], help="token events per stream per step"
    )
    ns = ap.parse_args()
    if ns.steps < 1 or min(ns.sizes) < 1 or min(ns.events) < 1:
        ap.error("--steps, --sizes and --events must be at least 1")
    print(f"machine: {machine()}; load average at the start: {load_average()}")
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(tmp).start()
        try:
            print(f"\n{ns.steps} steps per row, alternating")
            print(
                "| streams per step | events per stream | ours p50 / p90 (ms) "
                "| redis-py Script p50 / p90 (ms) | peer / ours (p50) "
                "| Redis time per step, ours / peer (ms) | Redis time per token event, ours (us) |"
            )
            print("|---:|---:|---:|---:|---:|---:|---:|")
            for size in ns.sizes:
                for events in ns.events:
                    r = run(server.url, size, ns.steps, events)
                    w, u = r["wall"], r["usec"]
                    ratio = statistics.median(w["peer"]) / statistics.median(w["ours"])
                    per_token = u["ours"] / (ns.steps * size * events)
                    print(
                        f"| {size} | {events} "
                        f"| {pct(w['ours'], 0.5):.2f} / {pct(w['ours'], 0.9):.2f} "
                        f"| {pct(w['peer'], 0.5):.2f} / {pct(w['peer'], 0.9):.2f} "
                        f"| {ratio:.2f}x "
                        f"| {u['ours'] / ns.steps / 1000:.2f} / {u['peer'] / ns.steps / 1000:.2f} "
                        f"| {per_token:.1f} |"
                    )
        finally:
            server.stop()
    print(f"\nload average at the end: {load_average()}")
    print("command: python -m bench.redis_append " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
