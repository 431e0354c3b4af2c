"""Smoke test of bench/redis_append.py: both append paths write every event (no timing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_redis_append_bench_tiny_run() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "redis_append.py"), "--steps", "5",
         "--sizes", "1", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    # the bench asserts that every append of both paths was written (status 1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(("| 1 |", "| 3 |"))]
    assert len(rows) == 2, proc.stdout
