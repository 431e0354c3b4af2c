"""bench/model_1b.py (the random test model) and the helpers of bench/vs_llamacpp.py
(bench/vs_llamacpp_servers.py, bench/long_prompts.py), without llama.cpp: the writer is
deterministic and copies the tokenizer; the long prompts are the same for a seed and
differ between seeds; a server's RSS sums its whole process tree."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import model_1b
from bench.long_prompts import long_text
from bench.vs_llamacpp import default_gguf
from bench.vs_llamacpp_servers import (
    KV_ELEM,
    KV_ELEM_FUSED,
    ServerConfig,
    process_tree,
    tree_rss,
)

pytestmark = pytest.mark.timeout(240)


def test_tiny_model_is_deterministic_and_carries_the_tokenizer(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    src = default_gguf()
    a = model_1b.write_f16(tmp_path / "a.gguf", "tiny", src, seed=3)
    b = model_1b.write_f16(tmp_path / "b.gguf", "tiny", src, seed=3)
    assert a.read_bytes() == b.read_bytes()
    assert not list(tmp_path.glob("*.tmp"))
    r, ref = gguf.GGUFReader(str(a)), gguf.GGUFReader(str(src))
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template",
                "tokenizer.ggml.eos_token_id"):  # fmt: skip
        assert r.fields[key].contents() == ref.fields[key].contents()
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 49152
    shape = model_1b.SHAPES["tiny"]
    assert r.fields["llama.block_count"].contents() == shape.layers
    assert r.fields["llama.rope.freq_base"].contents() == shape.rope_theta
    names = {t.name: t for t in r.tensors}
    assert "output.weight" not in names  # tied embeddings
    assert names["blk.0.attn_k.weight"].tensor_type.name == "F16"
    assert names["blk.0.attn_norm.weight"].data.min() == 1.0
    w = names["blk.1.ffn_up.weight"].data.astype("float32")
    assert abs(float(w.std()) - model_1b.STD) < 0.002
    assert model_1b.gguf_kv_shape(a) == {"layers": 2, "kv_heads": 2, "head_dim": 64}


def test_shortcuts_and_names() -> None:
    assert model_1b.parse_shortcut("1b-q4_k_m") == ("1b", "Q4_K_M")
    assert model_1b.parse_shortcut("1b-F16") == ("1b", "F16")
    assert model_1b.parse_shortcut("default") is None
    assert model_1b.parse_shortcut("/x/model.gguf") is None
    assert model_1b.model_path("1b", "Q8_0").name.endswith(".Q8_0.gguf")
    s = model_1b.SHAPES["1b"]
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.ffn) == (
        2048, 16, 32, 8, 64, 8192)  # fmt: skip


@pytest.mark.parametrize(("kv_elem", "weights"), [(("float16", 2), "auto"),
                                                 (("float32", 4), "fp32")])  # fmt: skip
def test_matched_kv_pool_holds_the_same_tokens(kv_elem: tuple[str, int], weights: str) -> None:
    shape = {"layers": 16, "kv_heads": 8, "head_dim": 64}
    cfg = ServerConfig(slots=16, ctx=8192, kv_tokens=8192,
                       kv_elem=KV_ELEM.get(weights, KV_ELEM_FUSED))  # fmt: skip
    assert cfg.kv_elem == kv_elem
    per_block = 2 * 16 * 16 * 8 * 64 * kv_elem[1]  # K and V of 16 tokens, all layers
    assert int(cfg.kv_gib(shape) * 2**30 // per_block) == 8192 // 16
    assert "512 blocks x 16 = 8192 tokens (--kv-cache-memory " in cfg.describe_ours(shape)
    assert cfg.describe_ours(shape).endswith(f"GiB at {kv_elem[0]})")
    assert cfg.describe_peer() == "-np 16 -c 8192 (512 tokens per slot)"


def test_long_prompts_are_reproducible_and_distinct() -> None:
    assert long_text(50, 1) == long_text(50, 1)
    a, b = long_text(50, 1)[0]["content"], long_text(50, 2)[0]["content"]
    assert a.splitlines()[0] != b.splitlines()[0]  # no shared prefix beyond the template
    assert len(long_text(100, 1)[0]["content"].splitlines()) == 102


def test_rss_sums_the_process_tree() -> None:
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \
        "'import time; x = b\"x\" * (64 << 20); time.sleep(60)']); time.sleep(60)"  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(process_tree(parent.pid)) < 2:
            time.sleep(0.1)
        assert len(process_tree(parent.pid)) == 2
        time.sleep(0.5)
        assert tree_rss(parent.pid) > 64 << 20  # the child's buffer counts
    finally:
        for pid in reversed(process_tree(parent.pid)):  # the child, then the parent
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait(10)
