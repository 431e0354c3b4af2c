"""Granite, OLMo 2 and Phi-3 from GGUF files, through our own metadata reader, served as
they are (engine/models/gguf_weights.py) or dense (engine/models/gguf_dense.py), against
transformers on the same random weights.

Each file is written here with gguf-py from a tiny random checkpoint of
tests/engine/models/test_families.py / test_phi3.py, as llama.cpp's converter writes it:
its architecture keys (Granite's four ``*_scale`` keys, Phi-3's rotated-value count,
original context, cos/sin scale and factor tensors), the tensor names of gguf-py's own
name map, Granite's q/k rows permuted (``LlamaModel.permute``), the norms in F32 and the
matrices in F32, F16, Q8_0 or Q4_0 (``gguf.quants.quantize``), the default model's
tokenizer. A quantized file is served natively (weights auto or native: the file's blocks
multiplied by our kernels, in the fused C step, and op by op in one case); an F32 or F16
one dense (weights auto, with a one-line note). The
greedy tokens must be transformers' on the checkpoint whose matrices are the file's
(dequantized: the numbers the engine multiplies).
"""

from __future__ import annotations

import copy
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tests.engine.models.test_families import Reference, build_checkpoint, prompts, run
from tests.engine.models.test_kquant_model import _copy_tokenizer
from tests.engine.models.test_phi3 import ORIGINAL, build_phi3
from tokenrelay.engine import EngineConfig, LLMEngine
from tokenrelay.engine.kernels import decoder
from tokenrelay.engine.kernels.quant import QUANT_TYPES, QuantStack, QuantWeight
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.gguf_file import GGUFIndex
from tokenrelay.engine.models.gguf_meta import write_metadata
from tokenrelay.engine.models.gguf_weights import fp32_bytes, load_gguf_model
from tokenrelay.engine.models.llama import CausalLM
from tokenrelay.engine.models.store import locate_model

__all__ = ["prompts"]  # the shared fixture: five prompts, 5 to 93 tokens
GGML = gguf.GGMLQuantizationType
ARCH = {"granite-bias": "granite", "olmo2": "olmo2", "phi3-longrope": "phi3"}
# (checkpoint, the file's matrices, --weights, decoder): quantized files served natively,
# through the fused C step (what a server runs) or op by op (TOKENRELAY_FUSED_DECODER=0)
CASES = [("granite-bias", "F32", "auto", "fused"), ("olmo2", "F16", "auto", "fused"),
         ("phi3-longrope", "Q8_0", "auto", "fused"), ("granite-bias", "Q8_0", "native", "fused"),
         ("olmo2", "Q4_0", "native", "fused"), ("olmo2", "Q4_0", "native", "op-by-op")]  # fmt: skip


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute`` of q/k rows (weights and biases)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _stored(w: np.ndarray, qtype: str) -> tuple[np.ndarray, Any]:
    """``w`` as the file holds it, and the ggml type (1-D tensors stay F32, as llama.cpp's)."""
    if w.ndim == 1 or qtype == "F32":
        return w.astype(np.float32), None
    if qtype == "F16":
        return w.astype(np.float16), None
    return gguf.quants.quantize(w.astype(np.float32), GGML[qtype]), GGML[qtype]


def _round_trip(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """What the file gives back for ``w``: its dequantized matrix."""
    if w.ndim == 1 or qtype == "F32":
        return w
    stored, raw = _stored(w.numpy(), qtype)
    back = stored.astype(np.float32) if raw is None else gguf.quants.dequantize(stored, raw)
    return torch.from_numpy(np.ascontiguousarray(back)).reshape(w.shape)


def write_gguf(path: Path, kind: str, hf: Any, qtype: str) -> Path:
    """``hf`` as llama.cpp's converter writes a ``kind`` model, matrices in ``qtype``."""
    c, arch = hf.config, ARCH[kind]
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = c.hidden_size // heads
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    if arch == "granite":  # GraniteModel(LlamaModel): the four multipliers as *_scale
        w.add_rope_dimension_count(head_dim)
        w.add_attention_scale(c.attention_multiplier)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
    if arch == "phi3":  # Phi3MiniModel: rotated values, original context, longrope tensors
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * c.hidden_size) // heads)
        w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        w.add_sliding_window(c.sliding_window or 0)  # 0: none
        scale = c.max_position_embeddings / c.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(ORIGINAL)))
        for name in ("long", "short"):
            factors = np.asarray(rope[f"{name}_factor"], dtype=np.float32)
            w.add_tensor(f"rope_factors_{name}.weight", factors)
    _copy_tokenizer(w)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    for hf_name, tensor in hf.state_dict().items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        t = tensor.detach().float()
        if arch == "granite" and ".q_proj." in hf_name:
            t = _permute(t, heads)
        elif arch == "granite" and ".k_proj." in hf_name:
            t = _permute(t, kv_heads)
        data, raw = _stored(t.numpy(), qtype)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def decoder_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``fused`` (the default: native weights run in one C call a step) or ``op-by-op``
    (``TOKENRELAY_FUSED_DECODER=0``, the operator's switch: each module on its weights)."""
    path = str(getattr(request, "param", "fused"))
    decoder.decoder_library.cache_clear()
    if path == "op-by-op":
        monkeypatch.setenv(decoder.FUSED_SWITCH, "0")
    elif decoder.decoder_library() is None:
        pytest.skip("the fused decoder did not build here (no C compiler?)")
    yield path
    decoder.decoder_library.cache_clear()  # read again once the switch is restored


def assert_decoder(model: CausalLM, path: str) -> None:
    """The step runs as ``path`` says: the fused C step, or the family's modules."""
    assert (model.fused is not None) == (path == "fused")


def assert_native(model: CausalLM, qtype: str, path: Path) -> None:
    """``model`` holds the file's blocks: every projection, the embedding and the LM head
    quantized in ``qtype``, fp32 only for the norms and biases."""
    for layer in model.decoder_layers():
        attn, mlp = layer.attn, layer.mlp
        for w in (attn.qkv_packed, attn.o_packed, mlp.gate_up_packed, mlp.down_packed):
            assert isinstance(w, QuantWeight | QuantStack), w
            assert set(w.qtypes if isinstance(w, QuantStack) else (w.qtype,)) == {qtype}
    for w in (model.embed_quant, model.head_packed):
        assert isinstance(w, QuantWeight) and w.qtype == qtype
    held = 4 * sum(p.numel() for p in model.parameters())
    assert held * 50 < fp32_bytes(GGUFIndex(path))  # what --weights fp32 would hold


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A $TOKENRELAY_HOME of this module's own: the prepared folders go there."""
    folder = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENRELAY_HOME", str(folder))
        yield folder


def _build(kind: str, folder: Path, tokenizer_dir: Path) -> Any:
    if kind.startswith("phi3"):
        return build_phi3(kind, folder, tokenizer_dir)
    return build_checkpoint(kind, folder, tokenizer_dir)


@pytest.mark.parametrize(("kind", "qtype", "weights", "decoder_path"), CASES,
                         indirect=["decoder_path"])  # fmt: skip
def test_greedy_from_a_gguf_is_transformers_on_its_weights(
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
    hf = _build(kind, tmp_path / "folder", model_path)
    path = write_gguf(tmp_path / f"{kind}-{qtype}.gguf", kind, hf, qtype)
    assert GGUFIndex(path).arch == ARCH[kind]
    ref_model = copy.deepcopy(hf)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.copy_(_round_trip(p.detach(), qtype))
    if qtype != "F32":
        assert not torch.equal(ref_model.lm_head.weight, hf.lm_head.weight)
    config = EngineConfig(model=str(path), device="cpu", num_blocks=128, weights=weights)
    with caplog.at_level(logging.WARNING, logger="tokenrelay.engine"):
        engine = LLMEngine(config)
    notes = [r for r in caplog.records if "dequantizing to fp32" in r.getMessage()]
    model = engine.runner.model
    if qtype in QUANT_TYPES:  # as it is, whether asked for or picked by auto
        assert not notes and engine.runner.weights == "native"
        assert_decoder(model, decoder_path)
        assert EngineConfig(model=str(path), device="cpu").weights_for("cpu") == "native"
        assert_native(model, qtype, path)
        if kind == "phi3-longrope":  # the file's fused q/k/v and gate/up, one tensor each
            layer = model.decoder_layers()[0]
            assert isinstance(layer.attn.qkv_packed, QuantWeight)
            assert isinstance(layer.mlp.gate_up_packed, QuantWeight)
    else:  # no blocks the kernels multiply: dequantized, with a note
        (note,) = notes
        assert f"is {qtype}, which the CPU kernels do not" in note.reason  # type: ignore[attr-defined]
        assert engine.runner.weights == "float32"
    assert str(engine.model_path).startswith(str(home))
    assert type(engine.runner.model).__name__ == hf.__class__.__name__
    # the folder's config, read back from the file's keys and tensors (the token ids are
    # the default tokenizer's; Phi-3's cos/sin scale is a key, the folder computes it)
    want = ModelConfig.from_pretrained(tmp_path / "folder")
    got = ModelConfig.from_pretrained(engine.model_path)
    if kind == "phi3-longrope":
        assert got.rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))
        got = replace(got, rope=replace(got.rope, attention_factor=None))
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # a float32 key
    same: dict[str, Any] = {"eos_token_ids": frozenset(), "bos_token_id": None,
                            "rms_norm_eps": want.rms_norm_eps}  # fmt: skip
    assert replace(got, **same) == replace(want, **same)
    chosen = [p for p in prompts if kind != "phi3-longrope" or len(p) > ORIGINAL]
    refs = [Reference(ref_model, p) for p in chosen]
    for i, ours in enumerate(run(engine, chosen)):
        refs[i].check(ours, f"{kind} {qtype} prompt {i}")


def _header_only(path: Path, arch: str) -> Path:
    """A GGUF of ``arch`` with its shape keys, a 3-token tokenizer and an embedding only."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in [("block_count", 1), ("embedding_length", 64), ("context_length", 64),
                       ("feed_forward_length", 128), ("attention.head_count", 4)]:  # fmt: skip
        w.add_uint32(f"{arch}.{key}", value)
    w.add_token_list(["a", "b", "ab"])
    w.add_tokenizer_model("gpt2")
    w.add_token_merges(["a b"])
    w.add_tensor("token_embd.weight", np.zeros((3, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["granite", "olmo2", "phi3", "gemma2", "gemma3"])
def test_native_weights_of_unquantized_matrices_are_refused_in_one_line(
    arch: str, home: Path, tmp_path: Path
) -> None:
    """A file of any family whose matrices the kernels do not multiply (here an F32
    embedding): weights=native says which tensor, before anything is prepared."""
    path = _header_only(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(ValueError) as err:
        EngineConfig(model=str(path), device="cpu", weights="native")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("weights=native: token_embd.weight is F32, which the CPU kernels")
    assert message.endswith("use weights auto or fp32")
    _, _, target = locate_model(str(path))  # refused before anything is prepared
    assert target is not None and not target.with_name(target.name + ".meta").exists()


def test_granite_defaults_are_llama_cpps(tmp_path: Path) -> None:
    """A Granite file without the scale keys: no scaling, and 1/sqrt(head_dim) attention."""
    write_metadata(_header_only(tmp_path / "g.gguf", "granite"), tmp_path / "meta")
    cfg = ModelConfig.from_pretrained(tmp_path / "meta")
    assert cfg.attention_scale == pytest.approx(16**-0.5)
    assert cfg.embedding_multiplier == cfg.residual_multiplier == cfg.logits_scaling == 1.0


def test_a_fused_matrix_of_other_rows_than_the_config_is_refused(
    tmp_path: Path, model_path: Path
) -> None:
    """Phi-3's fused ``attn_qkv`` and ``ffn_up`` are taken whole, each one quantized
    matrix: rows other than the config's q, k and v say so in one line."""
    hf = build_phi3("phi3-longrope", tmp_path / "folder", model_path)
    path = write_gguf(tmp_path / "phi3.gguf", "phi3-longrope", hf, "Q8_0")
    write_metadata(path, tmp_path / "meta")
    cfg = ModelConfig.from_pretrained(tmp_path / "meta")
    layer = load_gguf_model(path, cfg).decoder_layers()[0]
    assert isinstance(layer.attn.qkv_packed, QuantWeight) and layer.attn.qkv_packed.n == 128
    assert isinstance(layer.mlp.gate_up_packed, QuantWeight)
    message = "model: layers.0.attn.qkv_weight has shape (128, 64) in phi3.gguf, expected (96, 64)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        load_gguf_model(path, replace(cfg, num_kv_heads=1))  # 4 q heads, 1 k, 1 v of 16
