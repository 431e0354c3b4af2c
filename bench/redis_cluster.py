"""Token events appended per second: one Redis node against a 3-master Redis Cluster.

Both targets run in the same process tree, on this machine: the single node is the
embedded Redis (core/redis/embedded.py, on TCP), the cluster a
:class:`core.redis.local_cluster.LocalCluster`; both fsync their append-only files
alike (``--fsync``, default ``everysec`` as the embedded Redis). For each size, S
running streams (bench/token_source.py's ``create_streams``) are split over W writers,
each a :class:`worker.store.WorkerStore` (``cluster=True`` on the cluster) doing an
engine worker's decode steps back to back: one :meth:`~worker.store.WorkerStore.flush`
per step, one token event per stream. The writers are processes by default, so the
client is not held to one GIL (``--threads``: threads of this process). Rounds
alternate the targets (and which goes first), so noise hits both.

Reported per target and size: token events per second (every writer's events over
the round's wall time, from the common start to the last writer's end), the p50
of a writer's step, the Redis CPU time per token event (``INFO cpu`` of every node,
summed; the basis for sizing: a Redis core takes 1e6 / that many events a second), and
on the cluster how evenly the masters shared it (the busiest master's CPU over the
mean); and the ratios cluster / single. Every append must be written
(status 1), else the bench fails.

    .venv/bin/python -m bench.redis_cluster                 # 64 and 256 streams, 2 processes
    .venv/bin/python -m bench.redis_cluster --quick         # a short run (the test's)
    .venv/bin/python -m bench.redis_cluster --sizes 1024 --writers 4 --threads
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import load_average, machine
from bench.token_source import create_streams, stamp_text
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.redis.local_cluster import LocalCluster, cluster_unsupported_reason
from tokenrelay.core.wire.events import token_fields
from tokenrelay.worker.store import Batch, WorkerStore

SIZES = (64, 256)
BARRIER_TIMEOUT = 300.0  # s: every writer has created its streams by then
_barrier: Any = None  # the writers' common start (set in each writer process)


@dataclass(frozen=True)
class Job:
    """One writer's share of a round: its streams, appended ``steps`` times."""

    url: str
    cluster: bool
    writer: int
    streams: int
    steps: int


@dataclass
class Totals:
    """One target and size, summed over the rounds."""

    events: int = 0
    wall_s: float = 0.0
    steps_ms: list[float] = field(default_factory=list)
    node_cpu_s: list[float] = field(default_factory=list)  # Redis CPU per node, summed

    @property
    def cpu_us(self) -> float:
        """Redis CPU (all nodes) per token event, in microseconds."""
        return sum(self.node_cpu_s) / self.events * 1e6 if self.events else 0.0

    @property
    def imbalance(self) -> float:
        """The busiest node's CPU over the mean node's (1.0: perfectly even)."""
        mean = sum(self.node_cpu_s) / len(self.node_cpu_s) if self.node_cpu_s else 0.0
        return max(self.node_cpu_s) / mean if mean else float("nan")

    @property
    def rate(self) -> float:
        return self.events / self.wall_s if self.wall_s else 0.0

    @property
    def p50(self) -> float:
        return statistics.median(self.steps_ms)


def _init(barrier: Any) -> None:
    global _barrier
    _barrier = barrier


def write(job: Job) -> dict[str, Any]:
    """A writer: create its streams, wait for the others, then flush ``steps`` decode steps."""
    store: WorkerStore | None = None
    try:
        store = WorkerStore(job.url, f"bench-{job.writer}", cluster=job.cluster)
        sids = [sid for sid, _ in create_streams(store, job.streams, stream_ttl=600)]
    except BaseException:
        _barrier.abort()  # the other writers stop waiting for this one
        if store is not None:
            store.close()
        raise
    steps_ms: list[float] = []
    failed = 0
    try:
        _barrier.wait(BARRIER_TIMEOUT)
        start = time.monotonic()  # system-wide: comparable between processes
        for seq in range(1, job.steps + 1):
            fields = [token_fields(stamp_text(time.time()))]
            batches = [Batch(sid, seq, fields) for sid in sids]
            t = time.perf_counter()
            results = store.flush(batches)
            steps_ms.append((time.perf_counter() - t) * 1000)
            failed += sum(r.status != 1 for r in results) + len(batches) - len(results)
        end = time.monotonic()
    finally:
        store.close()
    return {"start": start, "end": end, "steps_ms": steps_ms, "failed": failed}


def node_cpu(nodes: list[Any]) -> list[float]:
    """Each node's CPU seconds so far (``INFO cpu``: user + sys, main thread and others)."""
    out = []
    for node in nodes:
        info = node.info("cpu")
        out.append(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))
    return out


def run_round(
    pool: Executor, url: str, cluster: bool, size: int, ns: argparse.Namespace, nodes: list[Any]
) -> Totals:
    """One round for one target: ``size`` streams over the writers, all starting together."""
    shares = [size // ns.writers + (w < size % ns.writers) for w in range(ns.writers)]
    jobs = [Job(url, cluster, w, n, ns.steps) for w, n in enumerate(shares)]
    cpu_before = node_cpu(nodes)  # (stream creation included: a small share)
    futures = [pool.submit(write, job) for job in jobs]
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:  # the writer that failed first, not those it left waiting at the barrier
        raise min(errors, key=lambda e: isinstance(e, threading.BrokenBarrierError))
    results = [f.result() for f in futures]
    failed = sum(r["failed"] for r in results)
    if failed:
        raise SystemExit(f"{failed} appends failed ({'cluster' if cluster else 'single'}, {size})")
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    steps = [ms for r in results for ms in r["steps_ms"]]
    cpu = [b - a for a, b in zip(cpu_before, node_cpu(nodes), strict=True)]
    return Totals(size * ns.steps, wall, steps, cpu)


def make_pool(ns: argparse.Namespace) -> Executor:
    """The writers: ``--writers`` processes (or threads), started once, with their barrier."""
    if ns.threads:
        _init(threading.Barrier(ns.writers))
        return ThreadPoolExecutor(ns.writers)
    ctx = multiprocessing.get_context("spawn")  # no fork of a process holding sockets
    barrier = ctx.Barrier(ns.writers)
    return ProcessPoolExecutor(ns.writers, mp_context=ctx, initializer=_init, initargs=(barrier,))


def measure(ns: argparse.Namespace, folder: Path) -> dict[tuple[str, int], Totals]:
    """Every round of every size, on both targets, alternating."""
    single = EmbeddedRedis(folder / "single", use_tcp=True, maxmemory=0).start()
    cluster = LocalCluster(folder / "cluster", masters=ns.masters)
    totals: dict[tuple[str, int], Totals] = {}
    try:
        cluster.start()
        clients = [single.client()] + [cluster.client(i) for i in range(ns.masters)]
        for c in clients:
            c.config_set("appendfsync", ns.fsync)
        targets: list[tuple[str, str, bool, list[Any]]] = [
            ("single", single.url, False, clients[:1]),
            ("cluster", cluster.url, True, clients[1:]),
        ]
        with make_pool(ns) as pool:
            for r in range(ns.rounds):
                for size in ns.sizes:
                    for name, url, on_cluster, nodes in targets[:: 1 if r % 2 == 0 else -1]:
                        got = run_round(pool, url, on_cluster, size, ns, nodes)
                        t = totals.setdefault((name, size), Totals())
                        t.events += got.events
                        t.wall_s += got.wall_s
                        t.steps_ms += got.steps_ms
                        cpu = t.node_cpu_s or [0.0] * len(got.node_cpu_s)
                        t.node_cpu_s = [a + b for a, b in zip(cpu, got.node_cpu_s, strict=True)]
        for c in clients:
            c.close()
    finally:
        cluster.stop()
        single.cleanup()
    return totals


def table(totals: dict[tuple[str, int], Totals], sizes: list[int], masters: int) -> str:
    """The markdown table: a row per target and size, then the cluster / single ratio."""
    label = {"single": "single node", "cluster": f"cluster ({masters} masters)"}
    lines = [
        "| target | streams | events/s | p50 step ms | Redis CPU us/event | busiest node / mean |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for size in sizes:
        one, many = totals[("single", size)], totals[("cluster", size)]
        for name, t in (("single", one), ("cluster", many)):
            lines.append(
                f"| {label[name]} | {size} | {t.rate:,.0f} | {t.p50:.2f} | {t.cpu_us:.1f} "
                f"| {t.imbalance:.2f} |"
            )
        ratio = many.rate / one.rate if one.rate else float("nan")
        cpu = many.cpu_us / one.cpu_us if one.cpu_us else float("nan")
        lines.append(
            f"| cluster / single | {size} | {ratio:.2f}x | {many.p50 / one.p50:.2f}x "
            f"| {cpu:.2f}x | |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.redis_cluster", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--sizes", type=int, nargs="+", help=f"streams (default: {SIZES})")
    ap.add_argument("--steps", type=int, help="steps per writer and round (default: 200)")
    ap.add_argument("--rounds", type=int, help="rounds per size and target (default: 3)")
    ap.add_argument("--writers", type=int, default=2, help="writer processes (or threads)")
    ap.add_argument("--threads", action="store_true", help="writers as threads, not processes")
    ap.add_argument("--masters", type=int, default=3, help="the cluster's masters")
    ap.add_argument("--fsync", choices=["everysec", "always", "no"], default="everysec")
    ap.add_argument(
        "--quick", action="store_true", help="a short run: 8 and 32 streams, 10 steps, 1 round"
    )
    ns = ap.parse_args()
    sizes, steps, rounds = ([8, 32], 10, 1) if ns.quick else (list(SIZES), 200, 3)
    ns.sizes, ns.steps, ns.rounds = ns.sizes or sizes, ns.steps or steps, ns.rounds or rounds
    if min(ns.sizes) < 1 or min(ns.steps, ns.rounds, ns.writers, ns.masters) < 1:
        ap.error("--sizes, --steps, --rounds, --writers and --masters must be at least 1")
    reason = cluster_unsupported_reason()
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    print(f"machine: {machine()}; load average at the start: {load_average()}")
    kind = "threads" if ns.threads else "processes"
    print(
        f"\n{ns.rounds} round(s) of {ns.steps} steps per size and target, alternating; "
        f"writers: {ns.writers} ({kind}); appendfsync {ns.fsync}; "
        "one token event per stream per step"
    )
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        totals = measure(ns, Path(tmp))
    print(table(totals, ns.sizes, ns.masters))
    written = sum(t.events for t in totals.values())
    print(f"\nevery append written: {written} token events, 0 failed")
    print(f"load average at the end: {load_average()}")
    print("command: python -m bench.redis_cluster " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
