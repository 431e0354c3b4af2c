"""Google's Gemma 2 (``model_type`` ``gemma2``) and Gemma 3 text (``gemma3_text``).

As transformers' ``modeling_gemma2.py`` and ``modeling_gemma3.py``, a layer is::

    x = x + post_attention_layernorm(attn(input_layernorm(x)))
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))

where every norm (the final one and Gemma 3's q/k norms too) is an RMSNorm scaled by
``1 + weight`` in fp32 (``blocks.OffsetRMSNorm``) and the MLP is GeGLU with the tanh
approximation of GELU (``blocks.GeGLUMLP``). Around Llama's GQA attention and its
fused projections:

- the token embeddings are multiplied by ``sqrt(hidden_size)``, rounded to the model's
  dtype first (transformers' ``embed_scale``: 55.5 rather than 55.43 in bf16);
- the softmax scale is ``query_pre_attn_scalar ** -0.5`` (``ModelConfig.attention_scale``);
- Gemma 2 soft-caps every attention score, ``cap * tanh(s / cap)`` with
  ``attn_logit_softcapping`` (the attention backends do it, ``attention/backend.py``);
  Gemma 3's attention has no cap, as in transformers, which ignores the field there;
- the logits are soft-capped the same way by ``final_logit_softcapping`` where it is
  set (Gemma 2's default 30);
- the local layers (``layer_types`` ``sliding_attention``) attend only to their last
  ``sliding_window`` tokens; the paged KV cache still keeps every block of theirs;
- Gemma 3 normalises q and k per head before RoPE, and its local layers rotate with
  their own base (``rope_local_base_freq``, or ``rope_parameters["sliding_attention"]``):
  ``ModelConfig.local_rope``, a second :class:`RotaryEmbedding`.

A quantized GGUF runs through the fused C step: its norms are given ``1 + weight``, its
activation, windows, soft cap and local RoPE table are data there.
Tensor parallelism splits it as it splits Llama: each rank computes its heads with the
same windows, soft-caps and RoPE tables, the norms are replicated, and the logits are
soft-capped once gathered whole.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from tokenrelay.engine.attention.metadata import AttentionMetadata
from tokenrelay.engine.kernels.decoder import LayerWeights, Shape
from tokenrelay.engine.models.blocks import GeGLUMLP, OffsetRMSNorm, RMSNorm
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.llama import Attention, CausalLM, Layer
from tokenrelay.engine.models.rope import RotaryEmbedding
from tokenrelay.engine.runner.kv_cache import KVCache


class GemmaAttention(Attention):
    """Llama's attention with Gemma's ``1 + weight`` q/k norms (Gemma 3)."""

    def qk_norms(self, cfg: ModelConfig) -> tuple[RMSNorm | None, RMSNorm | None]:
        if not cfg.qk_norm:
            return None, None
        return OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps), OffsetRMSNorm(
            cfg.head_dim, cfg.rms_norm_eps
        )


class GemmaDecoderLayer(Layer):
    """Both sublayers normalised before and after, each before its residual add."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_norm = OffsetRMSNorm(hidden, eps)
        self.attn = GemmaAttention(cfg, layer_idx)
        self.post_attn_norm = OffsetRMSNorm(hidden, eps)
        self.pre_ff_norm = OffsetRMSNorm(hidden, eps)
        self.mlp = GeGLUMLP(cfg)
        self.post_ff_norm = OffsetRMSNorm(hidden, eps)
        # Gemma 3's local layers rotate with their own RoPE (GemmaForCausalLM.local_rope)
        self.rotates_locally = cfg.local_rope is not None and self.attn.window is not None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        attn = self.attn(self.input_norm(x), cos, sin, rope, meta, kv_cache)
        x = x + self.post_attn_norm(attn)  # [T, hidden]
        return x + self.post_ff_norm(self.mlp(self.pre_ff_norm(x)))

    def fused_weights(self) -> LayerWeights | None:
        """Every norm as ``1 + weight``; the local layers rotate with the local table."""
        one = GemmaForCausalLM.fused_norm
        lw = self.fused_layer(
            one(self.input_norm), one(self.pre_ff_norm),
            attn_out_norm=one(self.post_attn_norm), mlp_out_norm=one(self.post_ff_norm),
            local_rope=self.rotates_locally,
        )  # fmt: skip
        q_norm, k_norm = self.attn.q_norm, self.attn.k_norm
        if lw is None or q_norm is None or k_norm is None:
            return lw
        return replace(lw, q_norm=one(q_norm), k_norm=one(k_norm))


class GemmaForCausalLM(CausalLM):
    """Gemma 2 and Gemma 3 (text): scaled embeddings, sandwich norms, sliding layers,
    soft-capped logits, a second RoPE for Gemma 3's local layers."""

    layer_class = GemmaDecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.local_rope: RotaryEmbedding | None = None  # Gemma 3's local layers' (init_rope)

    def init_rope(self, device: torch.device, *args: Any, **kwargs: Any) -> None:
        """Llama's tables for the global layers, and Gemma 3's local layers' own."""
        super().init_rope(device, *args, **kwargs)
        if self.cfg.local_rope is not None:
            self.local_rope = RotaryEmbedding(self.cfg.local_rope, self.cfg.head_dim, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` -> final-normed hidden states ``[T, hidden]``,
        each layer rotating q and k with its layer type's RoPE."""
        if self.fused is not None:  # the fused step picks each layer's table itself
            return super().forward(input_ids, positions, meta, kv_cache, logits)
        if self.rope is None:
            raise RuntimeError("CausalLM.init_rope() was not called")
        if logits is not None:
            raise ValueError("CausalLM: logits within the step need the fused decoder's head")
        x = self.embed_tokens(input_ids)  # [T, hidden]
        tables: dict[int, tuple[torch.Tensor, ...]] = {}  # cos, sin [T, 1, D/2] by RoPE
        for layer in self.decoder_layers():
            rope = self.rope
            if self.local_rope is not None and layer.attn.window is not None:
                rope = self.local_rope
            if id(rope) not in tables:
                tables[id(rope)] = rope.cos_sin(positions, x.dtype)
            cos, sin = tables[id(rope)]
            x = layer(x, cos, sin, rope, meta, kv_cache)
        return self.norm(x)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows ``[T, hidden]`` times ``sqrt(hidden)`` in their dtype."""
        x = super().embed_tokens(input_ids)
        return x * float(torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype))

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]``, soft-capped by ``final_logit_softcapping``."""
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def local_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Gemma 3's local layers' ``cos, sin``."""
        if self.local_rope is None:
            return None
        cos, sin = self.local_rope.cos_sin(positions, dtype)
        return cos, sin

    def fused_shape(self) -> Shape:
        """Llama's, with GeGLU."""
        return replace(super().fused_shape(), activation="gelu_tanh")

    @staticmethod
    def fused_norm(norm: RMSNorm) -> torch.Tensor:
        """``1 + weight``: the fused step's norms multiply by their weight as it is."""
        return 1.0 + norm.weight.float()
