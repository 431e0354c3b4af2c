"""The Llama decoder (Llama, Mistral, Qwen2, Qwen3) in plain PyTorch, and the base the
other families (``granite.py``, ``olmo2.py``) override.

Works on a flattened varlen batch: ``T`` tokens from any number of sequences,
each with its position, attending through the paged KV cache. Weights are
fused at load time (one q/k/v matmul, one gate/up matmul). The module is built
on the ``meta`` device and receives its tensors from :mod:`tokenrelay.engine.models.weights`.

A family changes the parts it needs through hooks: :class:`CausalLM`'s ``layer_class``,
:meth:`CausalLM.embed_tokens` and :meth:`CausalLM.finish_logits`;
:meth:`Attention.qk_norms` and :meth:`Attention.rotate_qk`; a :class:`Layer`'s
``forward`` (where the norms and the residual adds sit). Where its projections are
quantized, ``engine/kernels/csrc/decoder.c`` runs the whole step: a family maps its layer
onto the fused one with :meth:`Layer.fused_weights` and its scalars with
:meth:`CausalLM.fused_shape`.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenrelay.engine.attention.metadata import AttentionMetadata, paged_attention
from tokenrelay.engine.kernels import cpu_linear
from tokenrelay.engine.kernels.decoder import (
    FusedDecoder,
    LayerWeights,
    Projection,
    Shape,
    decoder_library,
)
from tokenrelay.engine.kernels.quant import QuantStack, QuantWeight
from tokenrelay.engine.models.blocks import (
    AttentionProjections,
    Collectives,
    GatedMLP,
    RMSNorm,
    param,
)
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.rope import RotaryEmbedding, rotary_dim
from tokenrelay.engine.runner.kv_cache import KVCache

__all__ = ["Attention", "CausalLM", "Collectives", "DecoderLayer", "Layer", "QuantRows"]

log = logging.getLogger("tokenrelay.engine")


class QuantRows(Protocol):
    """An embedding table kept quantized: dequantizes only the rows looked up."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` ``[T]`` -> fp32 rows ``[T, hidden]``."""
        ...


class Attention(AttentionProjections):
    """GQA self-attention through the paged KV cache: rotary q and k, optional per-head
    q/k norm (Qwen3), the checkpoint's softmax scale (Granite's ``attention_multiplier``),
    the layer's sliding window (Gemma, Phi-3, Mistral, Qwen2/3 where configured) and
    soft-capped scores (Gemma 2); ``None`` where the family has neither."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg)
        self.layer_idx = layer_idx
        self.scale = cfg.attention_scale
        self.window, self.softcap = cfg.window(layer_idx), cfg.attn_softcap
        self.q_norm, self.k_norm = self.qk_norms(cfg)

    def qk_norms(self, cfg: ModelConfig) -> tuple[RMSNorm | None, RMSNorm | None]:
        """The q and k norms (hook): per head over ``head_dim`` where ``qk_norm`` (Qwen3)."""
        if not cfg.qk_norm:
            return None, None
        return RMSNorm(cfg.head_dim, cfg.rms_norm_eps), RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def rotate_qk(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``qkv`` ``[T, (H + 2 Hkv) D]`` -> rotated ``q`` ``[T, H, D]``, ``k`` ``[T, Hkv, D]``
        (hook: where the q/k norms apply)."""
        t = qkv.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, : self.q_size].view(t, h, d))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, hkv, d))
            return rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        # rotate q and k in one go: [T, H + Hkv, D]
        qk = rope.apply(qkv[:, : self.q_size + self.kv_size].view(t, h + hkv, d), cos, sin)
        return qk[:, :h], qk[:, h:]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``; writes this layer's k/v into the cache."""
        t = x.shape[0]
        qkv = self.project_qkv(x)  # [T, (H + 2 Hkv) D]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotate_qk(qkv, cos, sin, rope)
        o = paged_attention(  # [T, H, D]
            q, k, v, kv_cache.k[self.layer_idx], kv_cache.v[self.layer_idx], meta, self.scale,
            self.window, self.softcap,
        )  # fmt: skip
        return self.project_out(o.reshape(t, self.q_size))


class Layer(nn.Module):
    """What every family's decoder layer has: ``attn`` and ``mlp`` (the handles the
    loaders, packing and tensor parallelism use) and one residual step."""

    attn: Attention
    mlp: GatedMLP

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """The residual stream ``x`` ``[T, hidden]`` after this layer."""
        raise NotImplementedError

    def fused_weights(self) -> LayerWeights | None:
        """This layer as the fused C step computes it, or ``None`` where it cannot (a
        projection not quantized, a family without the mapping). A family's hook: see
        :meth:`fused_layer`."""
        return None

    def fused_layer(
        self, input_norm: torch.Tensor | None, post_norm: torch.Tensor | None, **norms: Any
    ) -> LayerWeights | None:
        """:class:`LayerWeights` of this layer's quantized projections, biases, q/k norms
        and window, with the residual-stream norms given (``norms``: ``attn_out_norm``,
        ``mlp_out_norm``, ``local_rope``); ``None`` unless every projection is quantized."""
        attn, mlp = self.attn, self.mlp
        projections = (attn.qkv_packed, attn.o_packed, mlp.gate_up_packed, mlp.down_packed)
        if not all(isinstance(w, QuantWeight | QuantStack) for w in projections):
            return None
        qkv, o, gate_up, down = cast(tuple[Projection, ...], projections)
        return LayerWeights(
            input_norm=input_norm, qkv=qkv, o=o, post_norm=post_norm, gate_up=gate_up,
            down=down, qkv_bias=attn.qkv_bias,
            q_norm=None if attn.q_norm is None else attn.q_norm.weight,
            k_norm=None if attn.k_norm is None else attn.k_norm.weight,
            o_bias=attn.o_bias, gate_up_bias=mlp.gate_up_bias, down_bias=mlp.down_bias,
            window=attn.window, **norms,
        )  # fmt: skip


class DecoderLayer(Layer):
    """Pre-norm attention + MLP block with residual connections (Llama)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, rope, meta, kv_cache)
        return x + self.mlp(self.post_attn_norm(x))

    def fused_weights(self) -> LayerWeights | None:
        return self.fused_layer(self.input_norm.weight, self.post_attn_norm.weight)


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and the (possibly tied) LM head."""

    # the class of each decoder layer (a family's hook)
    layer_class: ClassVar[type[Layer]] = DecoderLayer
    # whether engine/parallel/ can split this family over ranks as it splits Llama
    tensor_parallel: ClassVar[bool] = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else param(cfg.vocab_size, cfg.hidden_size)
        self.rope: RotaryEmbedding | None = None  # set by init_rope() once weights are on device
        self.head_packed: cpu_linear.Prepared | None = None  # pack_linears() or GGUF
        # the token embedding kept quantized (engine/models/gguf_weights.py), if it is
        self.embed_quant: QuantRows | None = None
        # every layer in one C call, where all projections are quantized (fuse())
        self.fused: FusedDecoder | None = None
        # tensor parallel (set_parallel()): this rank's shards, the whole vocabulary's size
        self.tp: Collectives | None = None
        self.full_vocab = cfg.vocab_size

    def set_parallel(self, tp: Collectives, full_vocab: int) -> None:
        """Make this rank's shard (built with engine/parallel/layout.py's ``local_config``)
        reduce its row-parallel outputs and its vocabulary-parallel embedding and logits."""
        if not self.tensor_parallel:
            raise ValueError(
                f"tensor_parallel_size: model_type {self.cfg.model_type} runs on one rank only"
            )
        self.tp, self.full_vocab = tp, full_vocab
        for layer in self.decoder_layers():
            layer.attn.tp = layer.mlp.tp = tp

    def decoder_layers(self) -> list[Layer]:
        """The decoder layers, typed."""
        layers = []
        for layer in self.layers:
            assert isinstance(layer, Layer)
            layers.append(layer)
        return layers

    def fuse(self) -> bool:
        """Run the layers through ``engine/kernels/csrc/decoder.c`` from now on, if it can.

        It can when every projection is a :class:`QuantWeight` or :class:`QuantStack`
        (GGUF weights served as they are), the norms are fp32 and the compiled decoder is
        available (not switched off, a C compiler present). Returns whether the fused
        path is on.
        """
        library = decoder_library()
        if library is None:
            return False
        layers = [layer.fused_weights() for layer in self.decoder_layers()]
        if any(lw is None for lw in layers):
            return False
        head = self.head_packed if isinstance(self.head_packed, QuantWeight) else None
        final = self.fused_norm(self.norm)
        self.fused = FusedDecoder(
            library, self.fused_shape(), cast(list[LayerWeights], layers), final, head
        )
        return True

    def fused_shape(self) -> Shape:
        """The dimensions and shared scalars of the fused step (a family adds its own)."""
        cfg = self.cfg
        return Shape(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.rms_norm_eps, cfg.attention_scale,
            rotary_dim=rotary_dim(cfg.rope, cfg.head_dim), softcap=cfg.attn_softcap,
        )  # fmt: skip

    @staticmethod
    def fused_norm(norm: RMSNorm) -> torch.Tensor:
        """What the fused step multiplies after normalising (a family's hook: Gemma's
        ``1 + weight``)."""
        return norm.weight

    def pack_linears(self) -> None:
        """Reorder every projection and the LM head for oneDNN (CPU fp32; kernels/cpu_linear.py).

        The tied embedding keeps its dense copy for the lookup; an untied LM head
        is replaced by its packed copy.
        """
        for layer in self.decoder_layers():
            layer.attn.pack()
            layer.mlp.pack()
        if self.lm_head is None:
            self.head_packed = cpu_linear.pack(self.embed)
        else:
            self.head_packed = cpu_linear.pack(self.lm_head)
            self.lm_head = cpu_linear.placeholder(self.lm_head)
        # The checkpoint's tensors may be views of its memory-mapped file; copying what
        # stays dense (embedding, norms, biases) lets that mapping go, else it keeps every
        # weight the packed copies replaced resident.
        with torch.no_grad():
            for param in self.parameters():
                if param.numel():
                    param.data = param.data.clone()

    def init_rope(self, device: torch.device, context_len: int | None = None) -> None:
        """Build the rotary tables on ``device`` (after the weights are loaded) for sequences
        of up to ``context_len`` tokens (default: ``max_position_embeddings``; it picks
        ``longrope``'s factor list, rope.py)."""
        context = context_len if context_len is not None else self.cfg.max_position_embeddings
        self.rope = RotaryEmbedding(self.cfg.rope, self.cfg.head_dim, device, context)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` -> final-normed hidden states ``[T, hidden]``.

        ``logits`` (fp32 ``[T, vocab]``; only with the fused decoder built with the LM head,
        ``self.fused.vocab``): filled with every row's logits within the same step.
        """
        rope = self.rope
        if rope is None:
            raise RuntimeError("CausalLM.init_rope() was not called")
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = rope.cos_sin(positions, x.dtype)  # [T, 1, D/2]
        if self.fused is not None:
            if self.fused.kv is not kv_cache.data:
                self.fused.bind_cache(kv_cache.data)
            local = self.local_tables(positions, x.dtype) if self.fused.local_rope else None
            return self.fused.forward(
                x, cos, sin, meta.slot_mapping, meta.block_tables, meta.seq_of_token,
                meta.row_lens, logits, local,
            )  # fmt: skip
        if logits is not None:
            raise ValueError("CausalLM: logits within the step need the fused decoder's head")
        for layer in self.layers:
            x = layer(x, cos, sin, rope, meta, kv_cache)  # [T, hidden]
        return self.norm(x)

    def local_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``cos, sin`` of the local layers' own rotary (a family's hook: Gemma 3)."""
        return None

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` ``[T]`` -> the first layer's input ``[T, hidden]`` (a family's hook)."""
        if self.embed_quant is not None:
            return self.embed_quant.rows(input_ids)
        if self.tp is not None:
            return self._parallel_embedding(input_ids, self.tp)
        return F.embedding(input_ids, self.embed)

    def _parallel_embedding(self, input_ids: torch.Tensor, tp: Collectives) -> torch.Tensor:
        """Rows of this rank's vocabulary shard, zeros for the others' ids, summed: exact."""
        per = self.embed.shape[0]  # Vp rows: ids [rank * Vp, (rank + 1) * Vp)
        local = input_ids - tp.rank * per
        outside = (local < 0) | (local >= per)  # [T]
        x = F.embedding(local.clamp(0, per - 1), self.embed)  # [T, hidden]
        return tp.all_reduce(x.masked_fill_(outside[:, None], 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[N, hidden]`` -> fp32 logits ``[N, vocab]`` (the whole vocabulary,
        gathered from every rank's shard under tensor parallelism)."""
        weight = self.embed if self.lm_head is None else self.lm_head
        logits = cpu_linear.linear(hidden, weight, self.head_packed).float()
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits, self.full_vocab)
        return self.finish_logits(logits)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's fp32 output ``[N, vocab]`` -> the model's logits (a family's hook:
        Granite's scaling, Gemma's soft cap); also applied to the fused step's logits."""
        return logits
