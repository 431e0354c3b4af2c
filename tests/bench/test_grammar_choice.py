"""Smoke test of bench/grammar_choice.py on the chosen engine: its masks are right (no timing)."""

from __future__ import annotations

from tests.bench.benchrun import run_bench


def test_grammar_choice_tiny_run_on_llguidance() -> None:
    proc = run_bench(
        "grammar_choice",
        *("--engines", "llguidance", "--batch", "4", "--steps", "6"),
        *("--compile-reps", "1", "--walks", "1"),
        timeout=300,
    )
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| llguidance |")]
    timing, probes = rows[:2], rows[2:]
    assert [r.split("|")[2].strip() for r in timing] == ["json_object", "schema"], proc.stdout
    assert all(r.rstrip(" |").endswith("| 0") for r in timing), proc.stdout  # no bad step
    assert len(probes) == 1 and "| 0 in none |" in probes[0], proc.stdout
    assert "engine.guided apply_bitmask" in proc.stdout
