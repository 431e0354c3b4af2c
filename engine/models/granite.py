"""IBM Granite 3.x (``model_type`` ``granite``): Llama's decoder with four scalars.

As transformers' ``modeling_granite.py``:

- the token embeddings are multiplied by ``embedding_multiplier``;
- each sublayer's output (attention, MLP) is multiplied by ``residual_multiplier``
  before it is added to the residual stream;
- the softmax scale is ``attention_multiplier`` instead of ``1 / sqrt(head_dim)``
  (:attr:`ModelConfig.attention_scale`, which :class:`llama.Attention` reads);
- the logits are divided by ``logits_scaling``.

Everything else (pre-norm RMSNorm, SwiGLU, RoPE, GQA, optional attention and MLP
biases, tied embeddings) is Llama's. The fused C step takes the residual multiplier and the
softmax scale as scalars (a quantized GGUF runs fused); tensor parallelism splits it as it
splits Llama (the scalars are the same on every rank).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tokenrelay.engine.attention.metadata import AttentionMetadata
from tokenrelay.engine.kernels.decoder import Shape
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.llama import CausalLM, DecoderLayer
from tokenrelay.engine.models.rope import RotaryEmbedding
from tokenrelay.engine.runner.kv_cache import KVCache


class GraniteDecoderLayer(DecoderLayer):
    """Llama's pre-norm layer whose sublayer outputs are scaled before the residual adds."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        r = self.residual_multiplier
        x = x + self.attn(self.input_norm(x), cos, sin, rope, meta, kv_cache) * r  # [T, hidden]
        return x + self.mlp(self.post_attn_norm(x)) * r


class GraniteForCausalLM(CausalLM):
    """Granite: scaled embeddings, scaled residual branches, scaled logits."""

    layer_class = GraniteDecoderLayer

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows ``[T, hidden]`` times ``embedding_multiplier``."""
        return super().embed_tokens(input_ids) * self.cfg.embedding_multiplier

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` divided by ``logits_scaling``."""
        return logits / self.cfg.logits_scaling

    def fused_shape(self) -> Shape:
        """Llama's, with the residual multiplier."""
        return replace(super().fused_shape(), residual_scale=self.cfg.residual_multiplier)
