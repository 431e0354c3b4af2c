"""Smoke test of bench/vs_llamacpp.py: its tokenrelay half runs and prints the table.

No llama.cpp here (``--skip-llamacpp``): llama-server is a prerequisite of the
full bench only, never of the tests. Behaviour only, no timing asserts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.bench.benchrun import run_bench

pytestmark = pytest.mark.timeout(240)


def test_vs_llamacpp_tokenrelay_half(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    args = ["--skip-llamacpp", "--streams", "1,2", "--max-tokens", "8", "--out", str(out)]
    proc = run_bench("vs_llamacpp", *args, timeout=180)
    assert "## tokenrelay vs llama.cpp (CPU)" in proc.stdout
    assert "| streams | server | requests | tokens/request |" in proc.stdout
    # one row per level, every request generated exactly max_tokens (ignore_eos honoured)
    rows = re.findall(r"^\| (\d+) \| tokenrelay \| (\d+) \| (\S+) \|", proc.stdout, re.M)
    assert rows == [("1", "2", "8"), ("2", "4", "8")], proc.stdout[-2000:]
    assert "| tokenrelay / llama.cpp |" not in proc.stdout  # no peer, no ratio rows
    assert proc.stdout.count("| not measured | n/a |") == 3  # the targets, unmeasured
    assert out.read_text().startswith("## tokenrelay vs llama.cpp (CPU)")
    assert "llama-server" not in proc.stdout.split("## tokenrelay vs llama.cpp")[0]
