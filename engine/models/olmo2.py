"""AI2's OLMo 2 (``model_type`` ``olmo2``): norms after the sublayers, q/k norms over the
whole projections.

As transformers' ``modeling_olmo2.py``, a layer is::

    x = x + post_attention_layernorm(attn(x))
    x = x + post_feedforward_layernorm(mlp(x))

with no norm in front of either sublayer (Llama's ``input_layernorm`` does not exist),
and inside the attention::

    q = q_norm(q_proj(x))   # RMSNorm over all H * D values of a token, not per head
    k = k_norm(k_proj(x))   # over all Hkv * D
    q, k = rope(q), rope(k)

then Llama's GQA attention with ``1 / sqrt(head_dim)``. The final norm, SwiGLU MLP,
RoPE and the (untied by default) LM head are Llama's. Every OLMo norm scales in fp32
before casting (``RMSNorm(scale_in_fp32=True)``: the same as Llama's in fp32).

A quantized GGUF runs through the fused C step: no input norms, the norms on the
sublayers' outputs and the whole-projection q/k norms are data there.
Tensor parallelism splits it as it splits Llama; each rank also holds its heads' part of
the q/k norm weights, and the mean of squares of a token's whole q (and k) comes from one
all-reduce of every rank's sums of squares, q and k together (``blocks.split_rms_norms``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tokenrelay.engine.attention.metadata import AttentionMetadata
from tokenrelay.engine.kernels.decoder import LayerWeights, Shape
from tokenrelay.engine.models.blocks import GatedMLP, RMSNorm, split_rms_norms
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.llama import Attention, CausalLM, Layer
from tokenrelay.engine.models.rope import RotaryEmbedding
from tokenrelay.engine.runner.kv_cache import KVCache


class Olmo2Attention(Attention):
    """Llama's attention with RMSNorm over the full q and k projections before RoPE."""

    def qk_norms(self, cfg: ModelConfig) -> tuple[RMSNorm | None, RMSNorm | None]:
        """Norms over ``H * D`` (q) and ``Hkv * D`` (k) values."""
        eps = cfg.rms_norm_eps
        return (
            RMSNorm(cfg.num_heads * cfg.head_dim, eps, scale_in_fp32=True),
            RMSNorm(cfg.num_kv_heads * cfg.head_dim, eps, scale_in_fp32=True),
        )

    def rotate_qk(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise q ``[T, H D]`` and k ``[T, Hkv D]`` whole, then rotate them per head
        (under tensor parallelism: this rank's heads, by the means over every rank's)."""
        assert self.q_norm is not None and self.k_norm is not None
        t = qkv.shape[0]
        q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
        if self.tp is None:
            q, k = self.q_norm(q), self.k_norm(k)
        else:
            q, k = split_rms_norms([(self.q_norm, q), (self.k_norm, k)], self.tp)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        return rope.apply(q, cos, sin), rope.apply(k, cos, sin)


class Olmo2DecoderLayer(Layer):
    """Attention then MLP, each sublayer's output normalised before its residual add."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.attn = Olmo2Attention(cfg, layer_idx)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, eps, scale_in_fp32=True)
        self.mlp = GatedMLP(cfg)
        self.post_ff_norm = RMSNorm(cfg.hidden_size, eps, scale_in_fp32=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        x = x + self.post_attn_norm(self.attn(x, cos, sin, rope, meta, kv_cache))  # [T, hidden]
        return x + self.post_ff_norm(self.mlp(x))

    def fused_weights(self) -> LayerWeights | None:
        """No norm before either sublayer; one after each."""
        return self.fused_layer(
            None, None, attn_out_norm=self.post_attn_norm.weight,
            mlp_out_norm=self.post_ff_norm.weight,
        )  # fmt: skip


class Olmo2ForCausalLM(CausalLM):
    """OLMo 2: post-sublayer norms and full-projection q/k norms over Llama's pieces."""

    layer_class = Olmo2DecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, scale_in_fp32=True)

    def fused_shape(self) -> Shape:
        """Llama's, with q/k norms over the whole projections."""
        return replace(super().fused_shape(), qk_norm_whole=True)
