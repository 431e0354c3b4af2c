"""A GGUF file of a family the fused decoder does not compute, dequantized into a Hugging
Face folder with our own reader (Granite, OLMo 2, Phi-3, Gemma 2, Gemma 3).

transformers' GGUF loader has no mapping for some of these architectures, and the native
path (``gguf_weights.py``: quantized blocks, the fused C decoder) computes Llama's layer
only. So the file is prepared once, as ``store.convert_gguf`` prepares any GGUF served
dense: every tensor dequantized to fp32 (gguf-py's dequantizers, any ggml type they
know), renamed to its checkpoint name, written as ``model.safetensors`` beside the
``config.json`` and tokenizer that ``gguf_meta.write_metadata`` reads from the header.
The folder then loads like any Hugging Face folder (``weights.py``): op by op, on a CPU or
a GPU, in the dtype asked for.

The names are llama.cpp's (``gguf.constants.TENSOR_NAMES`` of each architecture). Its
converter permutes the q and k rows of the Llama-derived Granite for its rotary layout
(``LlamaModel.permute``, weights and biases); that is undone here. OLMo 2 and Phi-3 are
written as they are; Phi-3's q/k/v and gate/up stay fused (``attn_qkv``, ``ffn_up``) and
its ``longrope`` factor tensors are config (``gguf_meta.py``), not weights.

Gemma's converter (``Gemma2Model``, ``Gemma3Model``) adds 1 to every norm weight, the
q/k norms too, as its RMSNorm scales by ``1 + weight``: the file holds ``w + 1``, and 1
is taken off here to give the checkpoint's ``w`` back. In a Gemma file ``ffn_norm`` is
the norm before the MLP (``pre_feedforward_layernorm``), not Llama's
``post_attention_layernorm``; ``post_attention_norm`` and ``post_ffw_norm`` are the
norms after attention and the MLP.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tokenrelay.engine.models.gguf_file import GGUFIndex
from tokenrelay.engine.models.gguf_meta import DENSE_ARCHITECTURES, write_metadata
from tokenrelay.engine.models.gguf_weights import unpermute_rows

# architectures prepared here rather than by transformers
ARCHITECTURES = DENSE_ARCHITECTURES
_PERMUTED = ("granite",)  # q/k rows permuted by llama.cpp's converter (LlamaModel)
_NORMS_PLUS_ONE = ("gemma2", "gemma3")  # the converter stores each norm weight + 1
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_CONFIG_ONLY = ("rope_factors_short.weight", "rope_factors_long.weight", "rope_freqs.weight")
# GGUF name within a block -> the checkpoint's name within ``model.layers.N.``
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",  # OLMo 2, Gemma
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",  # OLMo 2, Gemma
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3: q, k, v in one
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_FUSED_UP = {"ffn_up.weight": "mlp.gate_up_proj.weight"}  # Phi-3: gate, then up, in one
# per architecture, where a name means another tensor than in _LAYER
_ARCH_LAYER = {
    arch: {**_LAYER, "ffn_norm.weight": "pre_feedforward_layernorm.weight"}
    for arch in ("gemma2", "gemma3")
}


def dequantized(index: GGUFIndex, name: str) -> torch.Tensor:
    """Tensor ``name`` of ``index`` in fp32, in the checkpoint's shape (GGUF dims reversed)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    info = index.tensors[name]
    try:
        qtype = GGMLQuantizationType[info.type_name]
    except KeyError:
        raise ValueError(f"model: {name} in {index.path.name} is {info.type_name}") from None
    shape = [int(d) for d in reversed(info.shape)]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    raw = np.asarray(index.data(name)).reshape(rows, -1)
    values = np.array(dequantize(raw, qtype), dtype=np.float32)  # a copy: not the file's map
    return torch.from_numpy(values).reshape(shape)


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a q or k weight ``[rows, ...]`` or bias."""
    return w[unpermute_rows(w.shape[0], n_heads)].contiguous()


def _weight(index: GGUFIndex, name: str) -> torch.Tensor:
    """Tensor ``name`` as the checkpoint holds it: Gemma's norms less the converter's 1."""
    tensor = dequantized(index, name)
    if index.arch in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
        tensor -= 1.0  # exact for stored values in [0.5, 2] (weights in [-0.5, 1])
    return tensor


def checkpoint_tensors(index: GGUFIndex) -> dict[str, torch.Tensor]:
    """Every weight of ``index`` in fp32 under its Hugging Face checkpoint name."""
    arch, meta = index.arch, index.metadata
    heads_key, kv_key = f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"
    heads, kv_heads = meta.get(heads_key), meta.get(kv_key) or meta.get(heads_key)
    if arch not in ARCHITECTURES:
        raise ValueError(f"model: {index.path.name}: architecture {arch!r} is not prepared here")
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        raise ValueError(f"model: {index.path.name} has no {heads_key}")
    fused_up = "blk.0.ffn_gate.weight" not in index.tensors
    layer_names = _ARCH_LAYER.get(arch, _LAYER)
    out: dict[str, torch.Tensor] = {}
    for name in index.tensors:
        if name in _CONFIG_ONLY:
            continue
        if name in _GLOBAL:
            out[_GLOBAL[name]] = _weight(index, name)
            continue
        parts = name.split(".", 2)
        local = parts[2] if len(parts) == 3 and parts[0] == "blk" else None
        target = (_FUSED_UP if fused_up else {}).get(local or "") or layer_names.get(local or "")
        if local is None or target is None:
            raise ValueError(f"model: {index.path.name} has a tensor {name} we do not map")
        tensor = _weight(index, name)
        if arch in _PERMUTED and local.startswith(("attn_q.", "attn_k.")):
            tensor = _unpermute(tensor, heads if local.startswith("attn_q.") else kv_heads)
        out[f"model.layers.{parts[1]}.{target}"] = tensor
    return out


def write_dense(gguf: Path, out: Path, progress: Callable[[str], None] = lambda line: None) -> None:
    """``gguf`` as a Hugging Face folder in ``out``: config, tokenizer, fp32 safetensors."""
    from safetensors.torch import save_file

    write_metadata(gguf, out, progress)
    started = time.monotonic()
    tensors = checkpoint_tensors(GGUFIndex(gguf))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    size = sum(t.numel() for t in tensors.values()) * 4 / 2**30
    progress(f"{len(tensors)} tensors dequantized to fp32, {size:.2f} GiB "
             f"({time.monotonic() - started:.1f} s)")  # fmt: skip
