"""Smoke test of bench/gateway.py: a tiny run completes and delivers every event in order.

Behaviour only (no timing asserts): 5 streams for 2 s through a real gateway
process and through the bare ``websockets`` server, then a short resume.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gateway_bench_tiny_run(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    args = ["--levels", "5", "--seconds", "2", "--rate", "20", "--backlog", "300"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gateway.py"), *args, "--resume-reps", "2",
         "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
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
