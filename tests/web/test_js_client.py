"""Run the JavaScript client's unit tests (tests/js/, Node's built-in runner) under pytest."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.root import ROOT


def _node() -> str | None:
    node = shutil.which("node")
    if node is None:
        return None
    out = subprocess.run([node, "--version"], capture_output=True, text=True, check=False)
    major = int(out.stdout.strip().lstrip("v").split(".")[0] or 0) if out.returncode == 0 else 0
    return node if major >= 20 else None


def test_js_client_unit_tests() -> None:
    node = _node()
    if node is None:
        pytest.skip("node >= 20 is not installed: the JS client unit tests (tests/js/) need it")
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "js").glob("*.test.mjs"))
    assert files, "no tests/js/*.test.mjs found"
    proc = subprocess.run(
        [node, "--test", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    summary = "\n".join(line for line in proc.stdout.splitlines() if line.startswith("# "))
    assert proc.returncode == 0, (
        f"node --test failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    )
    assert "# fail 0" in summary, summary
