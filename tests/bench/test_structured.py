"""Smoke test of bench/structured.py: a tiny run prints its table (no timing)."""

from __future__ import annotations

from tests.bench.benchrun import run_bench


def test_structured_tiny_run_prints_the_table() -> None:
    proc = run_bench("structured", "--quick", "--batch", "2", "--output-len", "4", timeout=300)
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| ")]
    assert rows[0].startswith("| run | tokens |"), proc.stdout
    names = [r.split("|")[1].strip() for r in rows[1:]]
    assert names == ["unconstrained", "json_schema"], proc.stdout
    assert all(r.split("|")[2].strip() == "8" for r in rows[1:]), proc.stdout  # 2 x 4 tokens
