"""Running a bench/ script from a test, as a user would: a child process in the repo root."""

from __future__ import annotations

import subprocess
import sys

from tests.root import ROOT


def run_bench(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python bench/<script> args...``; fails the test with its output if it fails."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc
