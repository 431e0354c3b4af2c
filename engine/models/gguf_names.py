"""llama.cpp's tensor names, per family, and what each tensor is in a Hugging Face checkpoint.

Both GGUF loaders read a file through these: ``gguf_weights.py`` (the file's quantized
blocks on our modules) and ``gguf_dense.py`` (every tensor dequantized into a Hugging Face
folder). The names are llama.cpp's (``gguf.constants.TENSOR_NAMES`` of each
architecture); :func:`checkpoint_names` gives each its checkpoint name, the one
``weights.py`` maps onto our modules. What llama.cpp's converter changed on the way, both
loaders undo:

- the q and k rows (weights and biases) of Llama, Mistral and Granite files are permuted
  for llama.cpp's rotary layout (``LlamaModel.permute``): :func:`rotary_heads` says which
  tensors, :func:`unpermute_rows` gives the rows back in the checkpoint's order. The
  other families rotate halves of each head, as transformers does, and are written as
  they are;
- Gemma's converter (``Gemma2Model``, ``Gemma3Model``) adds 1 to every norm weight, the
  q/k norms too, as its RMSNorm scales by ``1 + weight``: the file holds ``w + 1``, and
  :func:`norm_offset` is the 1 to take off;
- Phi-3 holds q/k/v in one ``attn_qkv`` and gate/up in one ``ffn_up`` (gate first; its
  file has no ``ffn_gate``), as its checkpoint does (``qkv_proj``, ``gate_up_proj``);
- in a Gemma file ``ffn_norm`` is the norm before the MLP (``pre_feedforward_layernorm``),
  not Llama's ``post_attention_layernorm``; ``post_attention_norm`` and ``post_ffw_norm``
  (OLMo 2 and Gemma) are the norms after attention and the MLP.

Phi-3's ``longrope`` factors and Llama 3's ``rope_freqs`` are tensors in the file but
config, not weights (``gguf_meta.py`` reads them): they have no checkpoint name.
"""

from __future__ import annotations

import torch

from tokenrelay.engine.models.gguf_file import GGUFIndex

CONFIG_ONLY = ("rope_factors_short.weight", "rope_factors_long.weight", "rope_freqs.weight")
PERMUTED = ("llama", "mistral", "granite")  # q/k rows permuted by llama.cpp's converter
NORMS_PLUS_ONE = ("gemma2", "gemma3")  # the converter stores each norm weight + 1
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
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


def checkpoint_names(index: GGUFIndex) -> dict[str, str]:
    """Every weight of ``index`` (GGUF name) -> its Hugging Face checkpoint name
    (``model.layers.3.self_attn.q_proj.weight``); config tensors left out, and one clear
    line for a tensor we do not map."""
    fused_up = "blk.0.ffn_gate.weight" not in index.tensors
    layer_names = _ARCH_LAYER.get(index.arch, _LAYER)
    out: dict[str, str] = {}
    for name in index.tensors:
        if name in CONFIG_ONLY:
            continue
        if name in _GLOBAL:
            out[name] = _GLOBAL[name]
            continue
        parts = name.split(".", 2)
        local = parts[2] if len(parts) == 3 and parts[0] == "blk" else ""
        target = (_FUSED_UP if fused_up else {}).get(local) or layer_names.get(local)
        if target is None or not parts[1].isdigit():
            raise ValueError(f"model: {index.path.name} has a tensor {name} we do not map")
        out[name] = f"model.layers.{parts[1]}.{target}"
    return out


def rotary_heads(index: GGUFIndex, name: str) -> int | None:
    """The heads whose rows the converter permuted in tensor ``name`` (a q or k weight or
    bias of a :data:`PERMUTED` family), or None where it is as the checkpoint has it."""
    arch = index.arch
    local = name.split(".", 2)[-1] if name.startswith("blk.") else ""
    if arch not in PERMUTED or not local.startswith(("attn_q.", "attn_k.")):
        return None
    heads_key = f"{arch}.attention.head_count"
    meta = index.metadata
    heads = meta.get(heads_key) if local.startswith("attn_q.") else None
    if heads is None:
        heads = meta.get(f"{heads_key}_kv") or meta.get(heads_key)
    if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0:
        raise ValueError(f"model: {index.path.name} has no {heads_key}")
    return heads


def norm_offset(arch: str, name: str) -> float:
    """What the converter added to tensor ``name`` of an ``arch`` file: 1 for Gemma's
    norms, else 0."""
    return 1.0 if arch in NORMS_PLUS_ONE and name.endswith("norm.weight") else 0.0


def unpermute_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """Row index that undoes llama.cpp's rotary permutation of a q or k projection.

    The converter reorders each head's rows from ``[half0 | half1]`` interleaving to
    pairs; ``w_hf = w_gguf[index]``.
    """
    dim = n_rows // n_heads // 2
    return torch.arange(n_rows).reshape(n_heads, dim, 2).transpose(1, 2).reshape(n_rows)
