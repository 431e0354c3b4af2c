"""bench.faults end to end: network cut, gateway / Redis / worker SIGKILL, request takeover.

The worker kill has 8 streams in flight on two workers: the killed worker's streams are
continued by the other and every stream ends ``length`` with the uninterrupted text.

tests/e2e/test_faults.py covers a clean Redis restart and a killed worker
in detail; this runs the cases it does not (and the worker kill with two
workers) through the hand-run tool, so the table in docs/reliability.md is
what the suite checks: every case injects its fault and loses nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.root import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_fault_injection_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    args = ["--streams", "8", "--tokens", "24", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.faults", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["case"].split(" ")[0]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"net-cut", "gateway-kill", "redis-kill", "worker-kill", "takeover"}
    for name, row in rows.items():
        assert row["lost"] == 0, (name, row)
        assert row["faults"] >= 1 and row["streams"] == 8, (name, row)
        assert row["ended_error"] == 0, (name, row)
    # the killed worker's streams were continued by the other one: all complete, text equal
    kill = rows["worker-kill"]["stats"]
    assert kill["continued"] >= 4, kill  # the victim held at least half of them
