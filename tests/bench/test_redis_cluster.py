"""Smoke test of bench/redis_cluster.py: both targets measured, every append written (no timing)."""

from __future__ import annotations

import pytest

from tests.bench.benchrun import run_bench
from tokenrelay.core.redis.local_cluster import cluster_unsupported_reason


def test_redis_cluster_bench_quick_run() -> None:
    reason = cluster_unsupported_reason()
    if reason is not None:
        pytest.skip(reason)
    # the bench fails (exit status) if any append of either target was not written
    proc = run_bench("redis_cluster", "--quick", timeout=180)
    out = proc.stdout
    assert "| target | streams | events/s | p50 step ms | Redis CPU us/event |" in out, out
    rows = [[c.strip() for c in ln.split("|")[1:-1]] for ln in out.splitlines() if ln[:2] == "| "]
    measured = [(r[0], r[1]) for r in rows[1:] if r[0] != "cluster / single"]
    assert measured == [
        (target, size) for size in ("8", "32") for target in ("single node", "cluster (3 masters)")
    ], out
    assert [r[1] for r in rows if r[0] == "cluster / single"] == ["8", "32"], out
    assert all(float(r[2].replace(",", "")) > 0 for r in rows[1:] if r[0] != "cluster / single")
    assert "every append written: 800 token events, 0 failed" in out, out


def test_redis_cluster_bench_threads_one_writer() -> None:
    reason = cluster_unsupported_reason()
    if reason is not None:
        pytest.skip(reason)
    proc = run_bench(
        "redis_cluster", "--quick", "--threads", "--writers", "1", "--sizes", "3", timeout=180
    )
    assert "writers: 1 (threads)" in proc.stdout, proc.stdout
    assert "every append written: 60 token events, 0 failed" in proc.stdout, proc.stdout
