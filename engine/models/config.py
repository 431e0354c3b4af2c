"""The architecture of a checkpoint, read from its ``config.json``.

Supported ``model_type`` values: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` (the Llama
decoder, ``llama.py``), ``granite`` (Llama's layer with four scalar multipliers,
``granite.py``), ``olmo2`` (norms after the sublayers, q/k norms over the whole
projections, ``olmo2.py``) and ``phi3`` (Phi-3/3.5/4: fused checkpoint weights, partial
rotary, ``longrope``; ``phi3.py``); anything else is refused in one line naming that list.
RoPE scaling types: ``default``, ``linear``, ``llama3``, ``yarn`` and ``longrope`` (``su``)
(the ``dynamic`` NTK variant depends on the running sequence length and is rejected);
``partial_rotary_factor`` rotates the first part of each head only (``rope.py``).
Sliding windows (``layer_windows``: a query sees its last ``sliding_window`` keys), as
transformers' masks: Mistral's ``sliding_window`` on every layer, Qwen2's and Qwen3's only
with ``use_sliding_window`` and on the layers from ``max_window_layers`` on (or those
``layer_types`` names ``sliding_attention``) (``_sliding``); Llama has none. ``gemma2``
and ``gemma3_text`` (``gemma.py``): their local layers (``_gemma``), and Gemma 3
gives its local and global layers a RoPE each (per layer type in ``rope_parameters``).
``phi3``'s ``sliding_window`` applies to every layer (``_phi3``), as transformers' mask.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "granite", "olmo2", "phi3", "gemma2", "gemma3_text"
)  # fmt: skip
GEMMA_TYPES = ("gemma2", "gemma3_text")  # gemma.py; their fields: _gemma()
SLIDING_TYPES = ("mistral", "qwen2", "qwen3")  # their windows: _sliding()
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (``rope_type`` plus its scaling fields)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # the share of each head that rotates (Phi-4-mini: 0.75)
    partial_rotary_factor: float = 1.0
    # longrope (Phi-3): per-frequency divisors below / above the original context
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to know about a checkpoint's shapes."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2 always; Llama attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # bias on gate/up/down (Llama mlp_bias)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    qk_norm_full: bool = False  # RMSNorm over the whole q and k projections (OLMo 2)
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    bos_token_id: int | None = None
    # Granite's scalars (the identity elsewhere)
    embedding_multiplier: float = 1.0  # the token embeddings are multiplied by it
    residual_multiplier: float = 1.0  # each sublayer's output, before the residual add
    attention_multiplier: float | None = None  # the softmax scale; None: 1 / sqrt(head_dim)
    logits_scaling: float = 1.0  # the logits are divided by it
    # Gemma 2 / 3 (``_gemma``): each layer's sliding window (None: global; (): none has one),
    # the sliding layers' RoPE where it differs (Gemma 3), soft-capped scores and logits
    layer_windows: tuple[int | None, ...] = ()
    local_rope: RopeConfig | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return self.head_dim**-0.5

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (its queries see that many keys), or ``None``."""
        return self.layer_windows[layer] if self.layer_windows else None

    @classmethod
    def from_dict(
        cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from the parsed ``config.json`` (and ``generation_config.json``)."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type: {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        hidden = _int(cfg, "hidden_size")
        heads = _int(cfg, "num_attention_heads")
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if kv_heads <= 0 or heads % kv_heads:
            raise ValueError(
                f"num_key_value_heads: {kv_heads} must divide num_attention_heads ({heads})"
            )
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish") and model_type not in GEMMA_TYPES:
            raise ValueError(f"hidden_act: {act!r} is not supported (only silu)")
        max_pos = int(cfg.get("max_position_embeddings") or 4096)
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        if not eps > 0:
            raise ValueError(f"rms_norm_eps: expected a positive number in config.json, got {eps}")
        attn_bias = model_type != "mistral" and bool(cfg.get("attention_bias", False))
        gemma = _gemma(cfg, model_type, max_pos, head_dim) if model_type in GEMMA_TYPES else {}
        eos = _ids(cfg.get("eos_token_id"))
        if generation_config:
            eos |= _ids(generation_config.get("eos_token_id"))
        return cls(
            model_type=model_type,
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=hidden,
            num_layers=_int(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_int(cfg, "intermediate_size"),
            rms_norm_eps=eps,
            rope=gemma.pop("rope", None) or _rope(cfg, max_pos, head_dim),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type in GEMMA_TYPES)),
            # Qwen2 always has a qkv bias (and none on o_proj); Llama/Qwen3 use attention_bias.
            qkv_bias=model_type == "qwen2" or attn_bias,
            o_bias=model_type != "qwen2" and attn_bias,
            mlp_bias=model_type in ("llama", "granite") and bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            qk_norm_full=model_type == "olmo2",
            eos_token_ids=frozenset(eos),
            bos_token_id=cfg.get("bos_token_id"),
            **(_granite(cfg) if model_type == "granite" else {}),
            **(_phi3(cfg, max_pos) if model_type == "phi3" else {}),
            **(_sliding(cfg, model_type, max_pos) if model_type in SLIDING_TYPES else {}),
            **gemma,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` if any) in ``path``."""
        folder = Path(path)
        cfg_file = folder / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"model: {folder} has no config.json")
        cfg = json.loads(cfg_file.read_text())
        gen_file = folder / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else None
        return cls.from_dict(cfg, gen)


def _int(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key}: expected a positive integer in config.json, got {value!r}")
    return value


def _positive(cfg: dict[str, Any], key: str, default: float) -> float:
    """A positive finite number (an int or a float) in ``config.json``, else ``default``."""
    value = cfg.get(key, default)
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{key}: expected a positive number in config.json, got {value!r}")
    return float(value)


def _granite(cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's multipliers (transformers' ``GraniteConfig`` defaults: all 1.0; the
    attention multiplier replaces ``1 / sqrt(head_dim)``, so its default 1.0 is no scale)."""
    return {
        "embedding_multiplier": _positive(cfg, "embedding_multiplier", 1.0),
        "residual_multiplier": _positive(cfg, "residual_multiplier", 1.0),
        "attention_multiplier": _positive(cfg, "attention_multiplier", 1.0),
        "logits_scaling": _positive(cfg, "logits_scaling", 1.0),
    }


def _phi3(cfg: dict[str, Any], max_pos: int) -> dict[str, Any]:
    """Phi-3's ``sliding_window``: every layer attends to that many keys (transformers'
    sliding-window mask for the whole model; ``null`` or 0: the whole context). A window
    of at least ``max_position_embeddings`` (Phi-3-mini-128k's) hides nothing: left out."""
    window = cfg.get("sliding_window") or None
    if window is None:
        return {}
    window = _int({"sliding_window": window}, "sliding_window")
    if window >= max_pos:
        return {}
    return {"layer_windows": (window,) * _int(cfg, "num_hidden_layers")}


def _sliding(cfg: dict[str, Any], model_type: str, max_pos: int) -> dict[str, Any]:
    """Mistral's ``sliding_window`` on every layer; Qwen2's / Qwen3's only if
    ``use_sliding_window``, on the layers ``layer_types`` names ``sliding_attention``, else
    on those from ``max_window_layers`` (default 28) on, as ``Qwen2Config`` derives them.
    ``null``, 0 or no key (as a GGUF's metadata gives it): none. A window of at least
    ``max_position_embeddings`` hides no key of any sequence served: left out."""
    window = cfg.get("sliding_window") or None
    if window is None or (model_type != "mistral" and not cfg.get("use_sliding_window")):
        return {}
    window = _int({"sliding_window": window}, "sliding_window")
    layers, types = _int(cfg, "num_hidden_layers"), cfg.get("layer_types")
    if model_type == "mistral":  # transformers' Mistral ignores layer_types
        slides = [True] * layers
    elif types is None:
        first = cfg.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(
                f"max_window_layers: expected a non-negative integer in config.json, got {first!r}"
            )
        slides = [i >= first for i in range(layers)]
    else:
        kinds = ("sliding_attention", "full_attention")
        listed = isinstance(types, list) and len(types) == layers
        if not listed or any(t not in kinds for t in types):
            raise ValueError(f"layer_types: expected {layers} of {' or '.join(map(repr, kinds))}")
        slides = [t == kinds[0] for t in types]
    if window >= max_pos or not any(slides):
        return {}
    return {"layer_windows": tuple(window if s else None for s in slides)}


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _rope(cfg: dict[str, Any], max_pos: int, head_dim: int) -> RopeConfig:
    """Merge transformers-5 ``rope_parameters`` and older ``rope_theta``/``rope_scaling``."""
    params: dict[str, Any] = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("rope_parameters: per-layer-type RoPE parameters are not supported")
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's older name
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling.rope_type: {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = float(params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    rotary = int(head_dim * partial)
    if not 0 < partial <= 1 or rotary < 2 or rotary % 2:
        raise ValueError(
            f"partial_rotary_factor: {partial} of head_dim {head_dim} is not an even number "
            "of rotated values"
        )
    factor = params.get("factor")
    if rope_type in ("linear", "llama3") and factor is None:
        raise ValueError(f"rope_scaling.factor: required for rope_type {rope_type!r}")
    orig = params.get("original_max_position_embeddings") or cfg.get(
        "original_max_position_embeddings"
    )
    if rope_type in ("llama3", "yarn") and orig is None:
        orig = max_pos
    if rope_type == "yarn" and factor is None:
        factor = max_pos / int(orig or max_pos)
    short, long = None, None
    if rope_type == "longrope":  # transformers prefers Phi-3's top-level original length
        orig = cfg.get("original_max_position_embeddings") or orig or max_pos
        factor = factor if factor is not None else max_pos / int(orig or max_pos)
        short, long = (_factors(params, name, rotary // 2) for name in ("short", "long"))
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(factor if factor is not None else 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig is not None else None,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=_opt_float(params.get("attention_factor")),
        mscale=_opt_float(params.get("mscale")),
        mscale_all_dim=_opt_float(params.get("mscale_all_dim")),
        truncate=bool(params.get("truncate", True)),
        partial_rotary_factor=partial,
        short_factor=short,
        long_factor=long,
    )


def _factors(params: dict[str, Any], name: str, count: int) -> tuple[float, ...]:
    """longrope's ``short_factor`` or ``long_factor``: ``count`` positive numbers."""
    value = params.get(f"{name}_factor")
    values: list[Any] = value if isinstance(value, list) else []
    numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    if len(values) != count or len(numbers) != count or not all(v > 0 for v in numbers):
        raise ValueError(
            f"rope_scaling.{name}_factor: expected {count} positive numbers "
            "(one per rotated frequency)"
        )
    return tuple(float(v) for v in numbers)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _gemma(cfg: dict[str, Any], model_type: str, max_pos: int, head_dim: int) -> dict[str, Any]:
    """Gemma 2 / 3's fields, with transformers' ``Gemma2Config`` / ``Gemma3TextConfig``
    defaults: the softmax scale ``query_pre_attn_scalar ** -0.5``, which layers slide
    (``layer_types``, else every 2nd (Gemma 2) or ``sliding_window_pattern``-th layer
    global), the soft-caps (Gemma 3 attention has none), Gemma 3's two RoPEs."""
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation: {act!r} is not supported (only gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: only causal attention is supported")
    layers, gemma2 = _int(cfg, "num_hidden_layers"), model_type == "gemma2"
    kinds = ("sliding_attention", "full_attention")
    types = cfg.get("layer_types")
    if types is None:
        every = 2 if gemma2 else int(cfg.get("sliding_window_pattern") or 6)
        types = [kinds[0] if (i + 1) % every else kinds[1] for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in kinds for t in types):
        raise ValueError(f"layer_types: expected {layers} of {' or '.join(map(repr, kinds))}")
    window = cfg.get("sliding_window", 4096)
    if kinds[0] in types:
        window = _int({"sliding_window": window}, "sliding_window")
    fields: dict[str, Any] = {
        "layer_windows": tuple(window if t == kinds[0] else None for t in types),
        "attention_multiplier": _positive(cfg, "query_pre_attn_scalar", 256) ** -0.5,
        "final_softcap": _cap(cfg, "final_logit_softcapping", 30.0 if gemma2 else None),
        "attn_softcap": _cap(cfg, "attn_logit_softcapping", 50.0) if gemma2 else None,
    }
    params = cfg.get("rope_parameters") or {}
    if gemma2:
        return fields
    if any(isinstance(v, dict) for v in params.values()):  # transformers 5: by layer type
        plain = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_theta")}
        for name, kind, theta in (("rope", kinds[1], 1e6), ("local_rope", kinds[0], 1e4)):
            typed = {"rope_theta": theta, **(params.get(kind) or {})}
            fields[name] = _rope({**plain, "rope_parameters": typed}, max_pos, head_dim)
        return fields
    fields["rope"] = _rope({"rope_theta": 1e6, **cfg}, max_pos, head_dim)  # global layers
    local = {"rope_theta": float(cfg.get("rope_local_base_freq") or 1e4)}
    fields["local_rope"] = _rope({"rope_parameters": local}, max_pos, head_dim)
    return fields


def _cap(cfg: dict[str, Any], key: str, default: float | None) -> float | None:
    """A soft-cap: a positive number, or ``None`` (null in ``config.json``: no cap)."""
    value = cfg.get(key, default)
    return None if value is None else _positive({key: value}, key, 1.0)
