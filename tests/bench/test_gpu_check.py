"""bench.gpu_check: its CPU smoke mode end to end, and what it would print on a GPU.

No GPU here: ``--tiny --device cpu`` runs every phase that applies to a CPU (CUDA
graphs are n/a); the GPU verdicts are checked on a synthetic record, and the tie
analysis on hand-made logits. Behaviour only, no timing asserts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.gpu_check import PHASES
from bench.gpu_models import compare_greedy
from bench.gpu_report import summary_rows
from tests.bench.benchrun import run_bench
from tests.root import ROOT

pytestmark = pytest.mark.timeout(300)

CORRECTNESS = ("correctness_smollm2", "correctness_qwen3")


def test_cpu_smoke_runs_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = run_bench("gpu_check", "--tiny", "--device", "cpu", "--json", str(out), timeout=240)
    assert "| check | result | target | verdict |" in proc.stdout
    for check in ("engine", "copy bandwidth", *CORRECTNESS, "throughput", "batch-1 decode, eager"):
        assert f"| {check} |" in proc.stdout, proc.stdout

    data = json.loads(out.read_text())
    assert data["complete"] is True
    phases = data["phases"]
    assert list(phases) == list(PHASES)
    assert {k: v["status"] for k, v in phases.items()} == {
        **{k: "ok" for k in PHASES},
        "latency_graphs": "skipped",  # no CUDA graphs on a CPU
        "tensor_parallel": "skipped",  # TP=N needs N > 1 GPUs
    }
    assert phases["latency_graphs"]["reason"].startswith("n/a")
    assert phases["tensor_parallel"]["reason"].startswith("n/a: tensor parallelism across GPUs")
    assert "| tensor parallel | skipped: n/a" in proc.stdout
    for key in CORRECTNESS:
        rec = phases[key]
        # fp32 on both sides: every greedy token equal, no tie needed
        assert [r["verdict"] for r in rec["prompts"]] == ["equal"] * 8, rec["prompts"]
        assert all(r["tokens"] == 32 and r["agree"] == 1.0 for r in rec["prompts"])
        assert rec["passed"] is True
        assert rec["engine"]["dtype"] == "float32"
        assert rec["engine"]["attention_backend"] == "torch"
        assert rec["engine"]["graph_buckets"] == []
    assert phases["correctness_smollm2"]["max_num_batched_tokens"] == 32  # chunked prefill

    ours = phases["throughput_ours"]
    assert ours["partial"] is False
    assert ours["requests_done"] == ours["requests"] == 16
    assert ours["output_tokens"] == ours["requested_output_tokens"]  # ignore_eos honoured
    assert phases["throughput_transformers"]["requests"] == 16
    assert isinstance(data["ratio"], float)

    eager = phases["latency_eager"]
    assert eager["decode_steps"] == 23  # 24 tokens, the first from the prefill step
    assert eager["of_roofline"] is not None and eager["weight_bytes"] > 0
    # on a CPU the GPU targets are not judged
    verdicts = {row["check"]: row["verdict"] for row in data["summary"]}
    assert verdicts["throughput"] == verdicts["batch-1 decode, CUDA graphs"] == "n/a"
    assert verdicts["correctness_qwen3"] == "PASS"


def test_a_failing_phase_leaves_the_others_running(tmp_path: Path) -> None:
    """An engine that cannot start fails its phases; the transformers side still runs."""
    out = tmp_path / "gpu_check.json"
    args = ["--tiny", "--device", "cpu", "--attention-backend", "no-such-backend"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_check",
            *args,
            "--skip-hf-throughput",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert "Traceback" in proc.stderr  # printed, not swallowed
    phases = json.loads(out.read_text())["phases"]
    status = {k: v["status"] for k, v in phases.items()}
    assert status["bandwidth"] == "ok"
    for key in (*CORRECTNESS, "throughput_ours", "latency_eager"):
        assert status[key] == "failed", status
        assert "no-such-backend" in phases[key]["error"]
    assert status["throughput_transformers"] == "skipped"
    assert "| correctness_qwen3 | ERROR: " in proc.stdout


def _fake_record(ratio: float, of_roofline: float, failed: str = "") -> dict[str, Any]:
    engine = {
        "attention_backend": "triton",
        "dtype": "bfloat16",
        "block_size": 16,
        "graph_buckets": [1, 2, 4],
        "kv_blocks": 1000,
    }
    prompt = {"tokens": 32, "verdict": "equal"}
    correct: dict[str, Any] = {"status": "ok", "model": "m", "max_num_batched_tokens": None}
    correct.update(passed=True, equal=8, ties=0, mismatches=0, prompts=[prompt] * 8, engine=engine)
    tp = {"status": "ok", "name": "x", "output_tokens": 10, "seconds": 1.0, "partial": False}
    lat = {"status": "ok", "median_ms": 1.0, "tok_s": 1000.0, "roofline_ms": of_roofline}
    phases: dict[str, Any] = {
        "bandwidth": {"status": "ok", "gb_s": 4000.0, "bytes": 2**31},
        "correctness_smollm2": correct,
        "correctness_qwen3": correct,
        "latency_graphs": {**lat, "of_roofline": of_roofline},
        "throughput_ours": {**tp, "tok_s": ratio * 100, "engine": engine},
        "latency_eager": {**lat, "of_roofline": of_roofline / 4},
        "throughput_transformers": {**tp, "tok_s": 100.0},
    }
    if failed:
        phases[failed] = {"status": "failed", "error": "RuntimeError: boom | bang\nmore"}
    return {"phases": phases}


def _verdicts(rows: list[tuple[str, str, str, str]]) -> dict[str, str]:
    return {check: verdict for check, _, _, verdict in rows}


def test_gpu_targets_pass_and_fail() -> None:
    good = _verdicts(summary_rows(_fake_record(12.0, 0.6), cuda=True))
    assert good["throughput"] == good["batch-1 decode, CUDA graphs"] == "PASS"
    assert good["correctness_qwen3"] == "PASS"
    bad = _verdicts(summary_rows(_fake_record(5.0, 0.3), cuda=True))
    assert bad["throughput"] == bad["batch-1 decode, CUDA graphs"] == "**FAIL**"
    rows = summary_rows(_fake_record(12.0, 0.6, failed="correctness_qwen3"), cuda=True)
    cell = next(r for r in rows if r[0] == "correctness_qwen3")
    assert cell[1] == "ERROR: RuntimeError: boom / bang more" and cell[3] == "**FAIL**"
    assert "graph buckets 1,2,4" in rows[0][1]


def test_divergence_verdicts() -> None:
    import torch

    ref = [[5, 6, 7], [5, 6, 7], [5, 6, 7]]
    step = torch.zeros(3, 10)
    step[1, 6] = 2.0  # at step 1 transformers picks 6 ...
    step[1, 3] = 2.0  # ... tied with 3
    step[1, 4] = 1.0  # ... far above 4
    logits = [step, step, step]
    eps = torch.finfo(torch.bfloat16).eps
    rows = compare_greedy([[5, 6, 7], [5, 3, 9], [5, 4, 9]], ref, logits, eps, tie_ulps=4)
    assert [r["verdict"] for r in rows] == ["equal", "tie", "MISMATCH"]
    assert rows[1]["first_divergence"] == 1 and rows[1]["gap"] == 0.0
    assert rows[1]["ours_rank"] == 0 and rows[1]["top2_gap"] == 0.0
    assert rows[2]["gap"] == 1.0 and rows[2]["ours_rank"] == 2 and rows[2]["gap_ulps"] == 64
    assert rows[0]["agree"] == 1.0 and rows[2]["agree"] == pytest.approx(1 / 3)
