"""Running a bench from a test, as a user would: ``python -m bench.<name>`` in the repo root."""

from __future__ import annotations

import subprocess
import sys

from tests.root import ROOT


def run_bench(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m bench.<name> args...``; fails the test with its output if it fails."""
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc
