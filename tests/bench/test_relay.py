"""Smoke test of bench/relay.py: a tiny run delivers every token, in order, on both paths.

Behaviour only (no timing asserts): 1 and 2 streams of 10 tokens, directly from the
synthetic upstream and through a real gateway, Redis and relay worker.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.benchrun import run_bench


def test_relay_bench_tiny_run(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    args = ["--levels", "1,2", "--tokens", "10", "--interval", "0.01", "--json", str(out)]
    proc = run_bench("relay", *args, timeout=180)
    result = json.loads(out.read_text())
    levels = {(lv["streams"], lv["path"]): lv for lv in result["levels"]}
    assert set(levels) == {(n, p) for n in (1, 2) for p in ("direct", "relay")}
    for (streams, _), lv in levels.items():
        assert lv["errors"] == [], lv
        assert lv["tokens"] == streams * 10, lv
        assert lv["p50_ms"] > 0 and lv["p99_ms"] >= lv["p50_ms"]
    assert "## Relay latency" in proc.stdout and "| 2 |" in proc.stdout
