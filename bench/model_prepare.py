"""Preparing the default model: GGUF to safetensors, ours against transformers' own loading.

``tokenrelay model prepare`` (and the first ``make run`` on a fresh machine)
dequantizes the default model's GGUF file once through transformers
(engine/models/store.py). *ours* wraps that in ``gguf_parsed_once``: the file is
parsed once and gguf's tensor-name maps built once. The peer is the same
conversion as transformers does it on its own, which parses the file for the
config, the tokenizer and the weights, and rebuilds the name map per module.
Each run is a fresh process (imports included) writing into its own temporary
folder; the two alternate. The outputs are compared byte for byte.

    .venv/bin/python -m bench.model_prepare            # 2 runs each
    .venv/bin/python -m bench.model_prepare --runs 3
"""

from __future__ import annotations

import argparse
import filecmp
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, load_average, machine

CHILD = """
import contextlib, sys, time
from pathlib import Path
t = time.perf_counter()
import tokenrelay.engine.models.store as ms
if sys.argv[2] == "peer":
    ms.gguf_parsed_once = contextlib.nullcontext
ms._dequantize(ms.default_gguf_path(), Path(sys.argv[1]))
print(time.perf_counter() - t)
"""
FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")


def run(who: str, out: Path) -> float:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(out), who],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{who} failed:\n{proc.stderr[-3000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.model_prepare", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--runs", type=int, default=2, help="runs of each, alternating")
    ns = ap.parse_args()
    if ns.runs < 1:
        ap.error("--runs must be at least 1")
    print(f"machine: {machine()}; load average at the start: {load_average()}")
    seconds: dict[str, list[float]] = {"ours": [], "peer": []}
    identical = True
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(ns.runs):
            for who in ("ours", "peer"):
                seconds[who].append(run(who, Path(tmp) / f"{who}{i}"))
            a, b = Path(tmp) / f"ours{i}", Path(tmp) / f"peer{i}"
            identical &= all(filecmp.cmp(a / f, b / f, shallow=False) for f in FILES)
    print(f"\ndefault model GGUF -> safetensors, fresh processes, {ns.runs} runs each")
    print("| conversion | runs (s) | median (s) |")
    print("|---|---|---:|")
    names = {"ours": "ours (`gguf_parsed_once`)", "peer": "transformers on its own (peer)"}
    for who, xs in seconds.items():
        runs = " / ".join(f"{x:.1f}" for x in xs)
        print(f"| {names[who]} | {runs} | {statistics.median(xs):.1f} |")
    ratio = statistics.median(seconds["peer"]) / statistics.median(seconds["ours"])
    print(f"\npeer / ours: {ratio:.2f}x; outputs byte-identical: {'yes' if identical else 'NO'}")
    print(f"load average at the end: {load_average()}")
    print("command: python -m bench.model_prepare " + " ".join(sys.argv[1:]))
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
