"""Smoke test of bench/gateway.py: a tiny run completes and delivers every event in order.

Behaviour only (no timing asserts): 5 streams for 2 s through a real gateway
process and through the bare ``websockets`` server, then a short resume.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.benchrun import run_bench


def test_gateway_bench_tiny_run(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    args = ["--levels", "5", "--seconds", "2", "--rate", "20", "--backlog", "300"]
    proc = run_bench("gateway", *args, "--resume-reps", "2", "--json", str(out), timeout=180)
    result = json.loads(out.read_text())
    levels = {lvl["server"]: lvl for lvl in result["levels"]}
    assert set(levels) == {"bare", "gateway"}
    for lvl in levels.values():
        assert lvl["streams"] == 5
        assert lvl["expected"] == 5 * 40
        assert lvl["delivered"] == lvl["expected"], lvl
        assert lvl["errors"] == [], lvl
    assert len(result["resume_ms"]) == 2
    assert result["resume_errors"] == []
    assert "## Gateway" in proc.stdout
    # the run-queue wait of every process sharing the machine is reported
    assert set(levels["gateway"]["runq_ms_per_s"]) == {"server", "redis", "source", "client"}
    assert set(levels["bare"]["runq_ms_per_s"]) == {"server", "client"}
    assert all(v >= 0 for lvl in levels.values() for v in lvl["runq_ms_per_s"].values())
