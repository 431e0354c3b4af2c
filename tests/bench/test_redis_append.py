"""Smoke test of bench/redis_append.py: both append paths write every event (no timing)."""

from __future__ import annotations

from tests.bench.benchrun import run_bench


def test_redis_append_bench_tiny_run() -> None:
    # the bench asserts that every append of both paths was written (status 1)
    proc = run_bench("redis_append", "--steps", "5", "--sizes", "1", "3", timeout=120)
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(("| 1 |", "| 3 |"))]
    assert len(rows) == 2, proc.stdout


def test_redis_append_bench_several_events_per_append() -> None:
    proc = run_bench(
        "redis_append", "--steps", "4", "--sizes", "3", "--events", "1", "3", timeout=120
    )
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| 3 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["1", "3"], proc.stdout
