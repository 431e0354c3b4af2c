"""The official ``openai`` npm package, from Node, against a real gateway and worker.

tests/js/openai_sdk.mjs runs tests/js/openai_sdk_checks.mjs (the same scenario the
Chromium test on another origin runs, tests/web/test_openai_sdk_browser.py) with the
pinned SDK of tests/js (``make js``): a completion, a stream read to the end, an abort
while waiting for the answer, and an abort after the first chunks of a long stream. The
gateway sees that abort as a disconnect (its ``tokenrelay_disconnects_total`` grows and
the stream keeps generating), and the cancel with the stream's resume token ends it
with ``finish_reason: "cancelled"``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import httpx
import pytest

from tests.gateway.http.conftest import ApiStack
from tests.root import ROOT

SCRIPT = ROOT / "tests" / "js" / "openai_sdk.mjs"
SDK = ROOT / "tests" / "js" / "node_modules" / "openai"


def node() -> str:
    found = shutil.which("node")
    if found is None:
        pytest.skip("node >= 20 is not installed: the openai npm package test needs it")
    out = subprocess.run([found, "--version"], capture_output=True, text=True, check=False)
    major = out.stdout.strip().lstrip("v").split(".")[0]
    if out.returncode != 0 or not major.isdigit() or int(major) < 20:
        pytest.skip("node >= 20 is not installed: the openai npm package test needs it")
    if not (SDK / "package.json").exists():
        pytest.skip("tests/js/node_modules/openai is missing: run make js")
    return found


def disconnects(addr: str) -> float:
    text = httpx.get(f"http://{addr}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("tokenrelay_disconnects_total "):
            return float(line.split()[1])
    raise AssertionError("no tokenrelay_disconnects_total in /metrics")


def test_openai_js_sdk_streams_and_aborts(api_stack: ApiStack) -> None:
    exe = node()
    before = disconnects(api_stack.a)
    proc = subprocess.run(
        [exe, str(SCRIPT), f"http://{api_stack.a}/v1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    full = out["full"]
    assert full["object"] == "chat.completion" and full["text"]
    assert full["finish"] in ("stop", "length")
    assert full["requestId"] and full["streamId"]
    stream = out["stream"]
    assert stream["text"] and stream["finishes"] in (["stop"], ["length"])
    assert stream["chunks"] >= 3  # role chunk, text, finish chunk

    # an abort while the request is under way rejects with the SDK's abort error
    assert out["early"] == {"error": "APIUserAbortError", "isAbortError": True}

    abort = out["abort"]
    # openai 6.x ends the `for await` loop quietly when the signal fires mid-stream
    assert abort["error"] is None and abort["signalAborted"] and not abort["finished"]
    assert abort["contentChunks"] >= 2 and abort["hasToken"]
    # the abort is a disconnect, not a cancel: the stream was still generating ...
    assert abort["cancel"]["status"] == 200 and abort["cancel"]["state"] == "cancelling"
    # ... until the cancel with its resume token, which ends it
    assert abort["replay"] == {"status": 200, "finishes": ["cancelled"], "done": True}
    meta = api_stack.stream_meta(abort["streamId"])
    assert meta.get("st") == "done" and meta.get("fr") == "cancelled", meta
    deadline = time.monotonic() + 10  # the gateway saw the aborted fetch as a disconnect
    while disconnects(api_stack.a) < before + 1:
        assert time.monotonic() < deadline, "the gateway never saw the aborted stream go"
        time.sleep(0.2)
