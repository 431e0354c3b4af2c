"""A GGUF model's ``config.json`` and generation config, from the file's own metadata.

What the engine needs beside a GGUF file's weights (``store.resolve_gguf``'s
``<name>.meta`` folder) is read from the header through :class:`GGUFIndex`: the
architecture keys llama.cpp's converter writes (``<arch>.block_count``,
``<arch>.embedding_length``, ...), the token ids of ``tokenizer.ggml.*`` and the tensor
names (no ``output.weight``: the LM head is the token embedding). The tokenizer comes
from :mod:`engine.models.gguf_tokenizer`. Nothing goes through transformers' GGUF
conversion, which parses every metadata field into Python objects and knows only the
architectures it maps.

Llama 3.1+ files carry their ``llama3`` RoPE scaling as a tensor of per-dimension
divisors (``rope_freqs.weight``), not as keys: the parameters are recovered from it and
checked against it. Phi-3 files carry ``longrope``'s two factor lists as tensors too
(``rope_factors_short.weight``, ``rope_factors_long.weight``), with the original context
and the cos/sin scale as keys. Granite's four multipliers are llama.cpp's
``granite.embedding_scale``, ``granite.residual_scale``, ``granite.attention.scale`` and
``granite.logit_scale`` (a missing one is llama.cpp's default: no scaling, and
``1 / sqrt(head_dim)`` for the attention).

Gemma 2 and Gemma 3 (``_gemma``) carry their window and soft-caps as keys
(``<arch>.attention.sliding_window``, ``<arch>.attn_logit_softcapping``,
``<arch>.final_logit_softcapping``); the rest llama.cpp derives, and so does this reader:
which layers slide (every 2nd (Gemma 2) or 6th (Gemma 3) layer is global, its
``set_swa_pattern``), Gemma 3's local RoPE base (10000, unscaled; ``rope.freq_base`` and
the ``rope.scaling.*`` keys are the global layers'), and ``query_pre_attn_scalar``,
which the converter does not write: ``head_dim``, except for the 27B models (46 Gemma 2
or 62 Gemma 3 layers), whose scalar is ``hidden_size / num_attention_heads``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tokenrelay.engine.models.gguf_file import GGUFIndex

# GGUF general.architecture -> HF model_type (llama.cpp's names; each served natively by
# gguf_weights.py, or dequantized: gguf_dense.py, transformers for the Llama-shaped ones)
ARCHITECTURES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
    "granite": "granite", "olmo2": "olmo2", "phi3": "phi3", "gemma2": "gemma2",
    "gemma3": "gemma3_text",
}  # fmt: skip
_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# Gemma (llama.cpp's llama-model.cpp): every n-th layer global, the 27B's layer count
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B = {"gemma2": 46, "gemma3": 62}
# end-of-turn tokens that llama.cpp finds by their text (llama-vocab.cpp), the converter
# writing no eot id for them: Gemma's. (Its longer list would add tokens that the other
# families' own generation configs do not stop at, such as SmolLM2's <|endoftext|>.)
_END_OF_TURN = ("<end_of_turn>",)
# ggml type of the token embedding -> the checkpoint's dtype (quantized blocks: float32)
_DTYPES = {"F16": "float16", "BF16": "bfloat16"}
# Llama 3's rope_scaling beside the factor, as its checkpoints (3.1, 3.2, 3.3) give it
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_CONTEXT = 8192


def model_type(index: GGUFIndex) -> str:
    """The HF ``model_type`` of ``index``'s architecture; one clear line if unsupported."""
    arch = index.arch
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"model: {index.path.name} has architecture {arch!r}, which is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return ARCHITECTURES[arch]


def model_config(index: GGUFIndex) -> dict[str, Any]:
    """The HF-style ``config.json`` dict of a GGUF file (what ``ModelConfig`` reads)."""
    mtype, arch = model_type(index), index.arch
    meta: dict[str, Any] = index.metadata

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    def required(name: str) -> int:
        value = key(name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"model: {index.path.name} has no {arch}.{name}")
        return value

    hidden, heads = required("embedding_length"), required("attention.head_count")
    rotary = key("rope.dimension_count")  # Phi-3's counts the rotated values only
    head_dim = int(key("attention.key_length") or (arch != "phi3" and rotary) or hidden // heads)
    tensors = index.tensors
    cfg: dict[str, Any] = {
        "architectures": [_CLASSES[mtype]],
        "model_type": mtype,
        "vocab_size": _vocab_size(index),
        "hidden_size": hidden,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length") or 4096),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "attention_bias": mtype != "qwen2" and "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in tensors,
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": _dtype(index),
    }
    if rotary and int(rotary) != head_dim:
        cfg["partial_rotary_factor"] = int(rotary) / head_dim
    scaling = _rope_scaling(index, cfg)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    if arch == "granite":
        cfg.update(_granite(meta, head_dim))
    if arch == "phi3" and key("attention.sliding_window"):  # 0: none (Phi-4)
        cfg["sliding_window"] = int(key("attention.sliding_window"))
    if arch in _GEMMA_PATTERN:
        cfg.update(_gemma(index, cfg))
    for name in ("bos", "eos", "padding", "unknown"):
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        if isinstance(value, int):
            cfg[{"padding": "pad", "unknown": "unk"}.get(name, name) + "_token_id"] = value
    return cfg


def generation_config(
    index: GGUFIndex, config: dict[str, Any], vocab: dict[str, int] | None = None
) -> dict[str, Any]:
    """``generation_config.json``: the token ids, every end-of-generation id in ``eos``
    (with ``vocab``, the tokenizer's, the end-of-turn tokens no key names)."""
    eos = [config[k] for k in ("eos_token_id",) if k in config]
    for name in ("eot", "eom"):  # end of turn / of message (Llama 3's <|eot_id|>, <|eom_id|>)
        value = index.metadata.get(f"tokenizer.ggml.{name}_token_id")
        if isinstance(value, int) and value not in eos:
            eos.append(value)
    for text in _END_OF_TURN:
        value = (vocab or {}).get(text)
        if value is not None and value not in eos:
            eos.append(value)
    gen: dict[str, Any] = {k: config[k] for k in ("bos_token_id", "pad_token_id") if k in config}
    if eos:
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return gen


def write_metadata(
    gguf: Path, out: Path, progress: Callable[[str], None] = lambda line: None
) -> None:
    """``config.json``, ``generation_config.json`` and the tokenizer of ``gguf`` into ``out``.

    ``progress`` gets one line per step (what is read, how large, how long it took).
    """
    from tokenrelay.engine.models.gguf_tokenizer import build_tokenizer, save_tokenizer

    started = time.monotonic()
    index = GGUFIndex(gguf)
    config = model_config(index)
    progress(
        f"{config['model_type']}: {config['num_hidden_layers']} layers, "
        f"hidden {config['hidden_size']}, vocabulary {config['vocab_size']}"
    )
    tokenizer = build_tokenizer(index, progress)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = generation_config(index, config, tokenizer.get_vocab())
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    save_tokenizer(tokenizer, out)
    progress(f"config and tokenizer written ({time.monotonic() - started:.1f} s)")


def _vocab_size(index: GGUFIndex) -> int:
    tokens = index.arrays.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return tokens.count
    value = index.metadata.get(f"{index.arch}.vocab_size")
    if isinstance(value, int):
        return value
    embedding = index.tensors.get("token_embd.weight")
    if embedding is None:
        raise ValueError(f"model: {index.path.name} has no token list and no token_embd.weight")
    return embedding.shape[-1]


def _dtype(index: GGUFIndex) -> str:
    embedding = index.tensors.get("token_embd.weight")
    return _DTYPES.get(embedding.type_name, "float32") if embedding else "float32"


def _rope_scaling(index: GGUFIndex, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from the ``<arch>.rope.scaling.*`` keys or ``rope_freqs.weight``."""
    prefix = f"{index.arch}.rope.scaling."
    meta: dict[str, Any] = index.metadata
    kind = meta.get(prefix + "type")
    factor = meta.get(prefix + "factor", meta.get(f"{index.arch}.rope.scale_linear"))
    if kind is None and factor is not None and float(factor) != 1.0:
        kind = "linear"  # older files: only rope.scale_linear
    if kind in (None, "none"):
        if "rope_factors_long.weight" in index.tensors:
            return _longrope_scaling(index, cfg)
        if "rope_freqs.weight" in index.tensors:
            return _llama3_scaling(index, cfg)
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    if factor is not None:
        scaling["factor"] = float(factor)
    original = meta.get(prefix + "original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    for gguf_name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if meta.get(prefix + gguf_name) is not None:
            scaling[hf_name] = float(meta[prefix + gguf_name])
    return scaling


def _decimal(value: Any) -> float:
    """A float32 key as the shortest decimal that reads back as it (``0.22``, not
    ``0.2199999988``): the number the checkpoint's ``config.json`` gave."""
    return float(str(np.float32(value)))


def _granite(meta: dict[str, Any], head_dim: int) -> dict[str, float]:
    """Granite's multipliers from llama.cpp's keys (written only where not zero)."""
    return {
        "embedding_multiplier": _decimal(meta.get("granite.embedding_scale") or 1.0),
        "residual_multiplier": _decimal(meta.get("granite.residual_scale") or 1.0),
        "attention_multiplier": _decimal(meta.get("granite.attention.scale") or head_dim**-0.5),
        "logits_scaling": _decimal(meta.get("granite.logit_scale") or 1.0),
    }


def _gemma(index: GGUFIndex, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 / 3's ``config.json`` fields: the file's keys, llama.cpp's defaults and
    derivations where it has none (the module docstring)."""
    arch, layers = index.arch, cfg["num_hidden_layers"]
    meta: dict[str, Any] = index.metadata

    def cap(name: str, default: float | None) -> float | None:
        value = meta.get(f"{arch}.{name}")
        return _decimal(value) if value else default

    window = meta.get(f"{arch}.attention.sliding_window")
    if window is None and arch == "gemma3":  # llama.cpp requires it; Gemma 2's default: 4096
        raise ValueError(f"model: {index.path.name} has no {arch}.attention.sliding_window")
    every, heads = _GEMMA_PATTERN[arch], cfg["num_attention_heads"]
    scalar = cfg["hidden_size"] // heads if layers == _GEMMA_27B[arch] else cfg["head_dim"]
    fields: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(window or 4096),
        "layer_types": [
            "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)
        ],
        "query_pre_attn_scalar": scalar,
    }
    if arch == "gemma2":  # llama.cpp's defaults where a cap is missing
        fields["attn_logit_softcapping"] = cap("attn_logit_softcapping", 50.0)
        fields["final_logit_softcapping"] = cap("final_logit_softcapping", 30.0)
    else:  # no attention cap; the final one written only where the model has one
        fields["final_logit_softcapping"] = cap("final_logit_softcapping", None)
        fields["rope_local_base_freq"] = 10000.0  # llama.cpp's, unscaled
    return fields


def _longrope_scaling(index: GGUFIndex, cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's ``longrope``: the factor tensors, the original context, the cos/sin scale."""
    arch, meta = index.arch, index.metadata
    factors = {}
    for name in ("short", "long"):
        info = index.tensors.get(f"rope_factors_{name}.weight")
        if info is None or info.type_name != "F32":
            raise ValueError(f"model: {index.path.name} has no F32 rope_factors_{name}.weight")
        raw = np.frombuffer(index.data(info.name).tobytes(), dtype="<f4")
        factors[f"{name}_factor"] = [_decimal(v) for v in raw]
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if not isinstance(original, int) or original <= 0:
        raise ValueError(
            f"model: {index.path.name} has no {arch}.rope.scaling.original_context_length"
        )
    cfg["original_max_position_embeddings"] = original
    scaling: dict[str, Any] = {"rope_type": "longrope", **factors}
    attn = meta.get(f"{arch}.rope.scaling.attn_factor")
    if attn is not None:
        scaling["attention_factor"] = _decimal(attn)
    return scaling


def _llama3_scaling(index: GGUFIndex, cfg: dict[str, Any]) -> dict[str, Any]:
    """Llama 3's ``rope_scaling``, recovered from the divisors llama.cpp stored per frequency."""
    info = index.tensors["rope_freqs.weight"]
    if info.type_name != "F32":
        raise ValueError(f"model: rope_freqs.weight in {index.path.name} is {info.type_name}")
    stored = np.frombuffer(index.data("rope_freqs.weight").tobytes(), dtype="<f4")
    factor = float(stored.max())
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        **_LLAMA3_ROPE,
        "original_max_position_embeddings": _LLAMA3_CONTEXT,
    }
    dim = cfg["head_dim"]
    freqs = 1.0 / cfg["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    low, high = _LLAMA3_ROPE["low_freq_factor"], _LLAMA3_ROPE["high_freq_factor"]
    wavelen = 2 * math.pi / freqs
    smooth = (_LLAMA3_CONTEXT / wavelen - low) / (high - low)
    want = np.where(
        wavelen < _LLAMA3_CONTEXT / high,
        1.0,
        np.where(wavelen > _LLAMA3_CONTEXT / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    if stored.shape != want.shape or not np.allclose(stored, want, rtol=1e-4):
        raise ValueError(
            f"model: rope_freqs.weight in {index.path.name} holds per-dimension RoPE factors "
            "other than Llama 3's; not supported"
        )
    return scaling
