"""bench/families_gguf.py's own parts: reading our runner's log line, the summary table, the
options. Making the files needs llama.cpp's converter and llama-quantize (prerequisites of
the bench only, never of the tests), so no file is made here."""

from __future__ import annotations

import json

import pytest

from bench import families_gguf as fg


def test_runner_ready_reads_json_and_text_lines() -> None:
    fields = {"msg": "model runner ready", "decoder": "fused", "weights": "native"}
    log = '{"msg": "loading model"}\n' + json.dumps(fields) + "\n"
    assert fg.runner_ready(log)["decoder"] == "fused"
    text = "12:00:00 info tokenrelay.runner: model runner ready  decoder=op-by-op weights=float32"
    assert fg.runner_ready(text) == {"decoder": "op-by-op", "weights": "float32"}
    assert fg.runner_ready("worker ready\n") == {}


def test_summary_reports_a_failed_family_and_its_reason() -> None:
    failed = fg.Result("phi3", error="SystemExit: convert_hf_to_gguf.py failed")
    refused = fg.Result("gemma2")
    refused.errors["tokenrelay"] = "RuntimeError: tokenrelay exited with 1 | blk.0"
    refused.types.update({"Q4_K": 2, "Q5_0": 1})
    table = fg.summary([failed, refused], [1, 8])
    head, rule, *rows = table.splitlines()
    assert head.count("|") == rule.count("|") == rows[0].count("|") == rows[1].count("|")
    assert "| tok/s (1) | tok/s (8) |" in head
    assert rows[0].startswith("| phi3 | - | - | - | - | - | - | - | SystemExit")
    assert "tokenrelay: RuntimeError: tokenrelay exited with 1 / blk.0" in rows[1]
    assert "not K-quants: Q5_0" in rows[1]


def test_options_are_checked() -> None:
    args = fg.parse_args(["--families", "llama,gemma3_text", "--streams", "1,8"])
    assert args.families == ["llama", "gemma3_text"] and args.streams == [1, 8]
    assert args.match_kv and args.long_prompts == [] and args.log_level == "info"
    with pytest.raises(SystemExit):
        fg.parse_args(["--families", "mistral"])
    with pytest.raises(SystemExit):
        fg.parse_args(["--streams", "none"])


def test_file_names_carry_family_and_format() -> None:
    path = fg.model_path("gemma2", "Q4_K_M")
    assert path.name == f"gemma2-{fg.TAG}-random-v{fg.FORMAT}.Q4_K_M.gguf"
    shape = {**fg.SHAPE, **fg.EXTRA["gemma2"]}
    # every matrix row a multiple of 256 (K-quants' block): hidden, heads x head_dim, FFN
    heads = shape["num_attention_heads"] * shape["head_dim"]
    assert all(n % 256 == 0 for n in (shape["hidden_size"], heads, shape["intermediate_size"]))
