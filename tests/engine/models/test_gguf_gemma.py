"""Gemma 2 and Gemma 3 from GGUF files (llama.cpp's ``gemma2`` and ``gemma3``), through
our own metadata reader, served as they are or dense, against transformers on the same
weights.

Each file is written here with gguf-py from a tiny random checkpoint (the one of
tests/engine/models/test_gemma.py: a window of 8 tokens, GQA, head_dim 16, the default
model's tokenizer) as llama.cpp's converter writes it (``Gemma2Model``,
``Gemma3Model``): its keys (the window, Gemma 2's two soft-caps, Gemma 3's global RoPE
base and ``linear`` scaling), gguf-py's tensor names, every norm weight plus 1, no
``lm_head`` for Gemma 2 (its converter drops it: tied), 1-D tensors in F32 and the
matrices in F16 or Q8_0. What the converter does not write, the checkpoints hold
as llama.cpp derives it: ``query_pre_attn_scalar`` = ``head_dim``, every 2nd (Gemma 2)
or 6th (Gemma 3: 6 layers, the last global) layer global, Gemma 3's local RoPE base
10000. The engine serves a quantized file as it is (weights auto or native, fused or op
by op: the file's blocks, its norms less 1 in our modules) and an F16 one dense (weights auto, a
one-line note; the folder it writes must hold the checkpoint's tensors); its greedy tokens
must be transformers' (eager attention) on the file's dequantized weights.
"""

from __future__ import annotations

import copy
import logging
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tests.engine.models.test_families import Reference, randomize, run
from tests.engine.models.test_gemma import GEMMA, WINDOW
from tests.engine.models.test_gguf_families import (
    _round_trip,
    _stored,
    assert_decoder,
    assert_native,
    decoder_path,
    home,
)
from tests.engine.models.test_gguf_families import prompts as prompts
from tests.engine.models.test_kquant_model import _copy_tokenizer
from tokenrelay.engine import EngineConfig, LLMEngine
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.gemma import GemmaForCausalLM
from tokenrelay.engine.models.gguf_meta import write_metadata
from tokenrelay.engine.models.weights import LAYER_NAMES

__all__ = ["decoder_path", "home", "prompts"]  # the shared fixtures
# (kind, the file's matrices, --weights, decoder): quantized files served natively, fused
# or op by op
CASES = [("gemma2", "F16", "auto", "fused"), ("gemma2", "Q8_0", "auto", "fused"),
         ("gemma3", "Q8_0", "native", "op-by-op"), ("gemma3", "Q4_0", "auto", "fused")]  # fmt: skip
HEAD_DIM = GEMMA["head_dim"]


def hf_config(kind: str) -> Any:
    """A config the file can say whole: the softmax scale is head_dim's, the local layers
    are llama.cpp's, Gemma 3's local RoPE base is llama.cpp's 10000."""
    from transformers import Gemma2Config, Gemma3TextConfig

    base = dict(GEMMA, query_pre_attn_scalar=HEAD_DIM)
    if kind == "gemma2":  # tied, as the file is; soft-caps low enough to bend the scores
        return Gemma2Config(**base, tie_word_embeddings=True, attn_logit_softcapping=3.0,
                            final_logit_softcapping=8.0)  # fmt: skip
    return Gemma3TextConfig(
        **dict(base, num_hidden_layers=6), tie_word_embeddings=False, sliding_window_pattern=6,
        rope_local_base_freq=10000.0, rope_theta=1e6,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    )  # fmt: skip


def build_gemma(kind: str, folder: Path, tokenizer_dir: Path) -> Any:
    """A random ``kind`` checkpoint saved in ``folder`` (norm weights around 0, as
    Gemma's); the transformers model, with eager attention."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = hf_config(kind)
    config._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomize(hf)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.sub_(1.0)
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return hf


def write_gemma_gguf(path: Path, hf: Any, qtype: str) -> Path:
    """``hf`` as llama.cpp's ``Gemma2Model`` / ``Gemma3Model`` write it, matrices in ``qtype``."""
    c = hf.config
    arch = "gemma2" if c.model_type == "gemma2" else "gemma3"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":  # no RoPE key: llama.cpp's default base 10000, transformers' too
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    else:  # TextModel's keys from the global layers' RoPE parameters
        rope = c.rope_parameters["full_attention"]
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_freq_base(rope["rope_theta"])
        assert c.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
        assert c.final_logit_softcapping is None  # written only where set
    _copy_tokenizer(w)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    for hf_name, tensor in hf.state_dict().items():
        if arch == "gemma2" and hf_name == "lm_head.weight":
            continue  # Gemma2Model.filter_tensors
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        t = tensor.detach().float()
        if hf_name.endswith("norm.weight"):
            t = t + 1  # Gemma's (1 + weight) RMSNorm: modify_tensors
        data, raw = _stored(t.numpy(), qtype)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def file_weights(hf: Any, qtype: str) -> Any:
    """``hf`` with the weights the file gives back: matrices dequantized, norms ``(w + 1) - 1``
    in fp32."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((p.detach() + 1) - 1)
            else:
                p.copy_(_round_trip(p.detach(), qtype))
    return ref


def assert_norms(model: GemmaForCausalLM, ref: Any) -> None:
    """Every norm of ``model`` is the checkpoint's (the file's ``w + 1`` less 1), under its
    name: ``ffn_norm`` the one before the MLP."""
    ours = dict(model.named_parameters())
    for name, tensor in ref.state_dict().items():
        if name == "model.norm.weight":
            assert torch.equal(ours["norm.weight"], tensor)
        elif "norm" in name:
            layer, local = name.removeprefix("model.layers.").split(".", 1)
            assert torch.equal(ours[f"layers.{layer}.{LAYER_NAMES[local]}"], tensor), name


@pytest.mark.parametrize(("kind", "qtype", "weights", "decoder_path"), CASES,
                         indirect=["decoder_path"])  # fmt: skip
def test_greedy_from_a_gemma_gguf_is_transformers_on_its_weights(
    kind: str,
    qtype: str,
    weights: str,
    home: Path,
    decoder_path: str,
    tmp_path: Path,
    model_path: Path,
    prompts: list[list[int]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from safetensors.torch import load_file

    hf = build_gemma(kind, tmp_path / "folder", model_path)
    path = write_gemma_gguf(tmp_path / f"{kind}-{qtype}.gguf", hf, qtype)
    ref_model = file_weights(hf, qtype)
    config = EngineConfig(model=str(path), device="cpu", num_blocks=128, weights=weights)
    with caplog.at_level(logging.WARNING, logger="tokenrelay.engine"):
        engine = LLMEngine(config)
    notes = [r for r in caplog.records if "dequantizing to fp32" in r.getMessage()]
    model = engine.runner.model
    assert str(engine.model_path).startswith(str(home))
    assert type(model) is GemmaForCausalLM
    if qtype != "F16":  # the file's blocks (the embedding too, scaled by sqrt(hidden))
        assert not notes and engine.runner.weights == "native"
        assert_decoder(model, decoder_path)
        assert_native(model, qtype, path)
        assert_norms(model, ref_model)
    else:  # dequantized, with a note; the folder holds the checkpoint's tensors under
        # their names: ffn_norm is the norm before the MLP, every norm less the converter's 1
        (note,) = notes
        assert "is F16, which the CPU kernels do not" in note.reason  # type: ignore[attr-defined]
        assert engine.runner.weights == "float32"
        folder = load_file(str(engine.model_path / "model.safetensors"))
        want = {k: v for k, v in ref_model.state_dict().items() if k in folder}
        assert sorted(folder) == sorted(want) and len(folder) == len(hf.state_dict()) - (
            kind == "gemma2"
        )
        for name, tensor in folder.items():
            assert torch.equal(tensor, want[name]), name
    # the folder's config, from the file's keys and llama.cpp's derivations
    cfg, hf_cfg = (ModelConfig.from_pretrained(p) for p in (engine.model_path, tmp_path / "folder"))
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-6)  # a float32 key
    same: dict[str, Any] = {"eos_token_ids": frozenset(), "bos_token_id": None, "rms_norm_eps": 1.0}
    assert replace(cfg, **same) == replace(hf_cfg, **same)
    assert cfg.attention_scale == HEAD_DIM**-0.5
    windows = (WINDOW, None, WINDOW) if kind == "gemma2" else (WINDOW,) * 5 + (None,)
    assert cfg.layer_windows == windows
    refs = [Reference(ref_model, p) for p in prompts]
    assert len({t for r in refs for t in r.tokens}) > 5  # not one token repeated
    for i, ours in enumerate(run(engine, prompts)):
        refs[i].check(ours, f"{kind} {qtype} prompt {i}")


def _header(
    path: Path,
    arch: str,
    layers: int,
    tokenizer: Callable[[gguf.GGUFWriter], int] | None = None,
    **floats: float,
) -> Path:
    """A ``arch`` file of ``layers`` layers (hidden 64, 4 heads of 32), its keys and a
    3-token tokenizer; ``tokenizer``: writes the tokenizer keys instead (and any others)
    and returns the vocabulary's size; ``floats``: more ``<arch>.*`` keys."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in [("block_count", layers), ("embedding_length", 64), ("context_length", 64),
                       ("feed_forward_length", 128), ("attention.head_count", 4),
                       ("attention.key_length", 32)]:  # fmt: skip
        w.add_uint32(f"{arch}.{key}", value)
    for key, number in floats.items():
        w.add_float32(f"{arch}.{key.replace('__', '.')}", number)
    vocab = 3 if tokenizer is None else tokenizer(w)
    if tokenizer is None:
        w.add_token_list(["a", "b", "ab"])
        w.add_tokenizer_model("gpt2")
        w.add_token_merges(["a b"])
    w.add_tensor("token_embd.weight", np.zeros((vocab, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(("arch", "layers"), [("gemma2", 46), ("gemma2", 42), ("gemma3", 62),
                                              ("gemma3", 34)])  # fmt: skip
def test_the_softmax_scale_and_the_local_layers_are_llama_cpps(
    arch: str, layers: int, tmp_path: Path
) -> None:
    """No key holds ``query_pre_attn_scalar``: llama.cpp takes hidden / heads for the 27B
    models (46 or 62 layers), else head_dim; every 2nd / 6th layer is global."""
    window = {"attention__sliding_window": 512.0} if arch == "gemma3" else {}
    write_metadata(_header(tmp_path / "g.gguf", arch, layers, **window), tmp_path / "meta")
    cfg = ModelConfig.from_pretrained(tmp_path / "meta")
    assert cfg.model_type == ("gemma2" if arch == "gemma2" else "gemma3_text")
    assert cfg.attention_scale == (16 if layers in (46, 62) else 32) ** -0.5
    every = 2 if arch == "gemma2" else 6
    assert [i for i, w in enumerate(cfg.layer_windows) if w is None] == list(
        range(every - 1, layers, every)
    )
    if arch == "gemma2":  # llama.cpp's defaults where the keys are missing
        assert set(cfg.layer_windows) == {4096, None}
        assert (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0)
    else:
        assert set(cfg.layer_windows) == {512, None} and cfg.final_softcap is None
        assert cfg.local_rope is not None and cfg.local_rope.theta == 10000.0


def test_a_gemma3_file_without_its_window_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^model: g\.gguf has no gemma3\.attention\.sliding"):
        write_metadata(_header(tmp_path / "g.gguf", "gemma3", 2), tmp_path / "meta")
