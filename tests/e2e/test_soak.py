"""bench/soak.py in its smoke mode: mixed traffic with drops and cancels, nothing leaks or is lost.

60 seconds by default (3 s samples) (TOKENRELAY_SOAK_SECONDS to change it); the
30-minute run is by hand: ``.venv/bin/python -m bench.soak --seconds 1800``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.bench.benchrun import run_bench

SECONDS = float(os.environ.get("TOKENRELAY_SOAK_SECONDS", "60"))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(SECONDS) + 600)]


def test_soak_smoke(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    args = ["--seconds", str(SECONDS), "--clients", "4", "--sample", "3", "--json", str(out)]
    run_bench("soak", *args, timeout=SECONDS + 540)
    result = json.loads(out.read_text())
    assert result["problems"] == [] and result["lost"] == 0
    assert result["leaked_blocks"] == 0 and result["blocks_total"] > 0
    assert result["streams"] >= 20 and result["drops"] > 0 and result["cancelled"] > 0
    assert len(result["samples"]) >= 10
