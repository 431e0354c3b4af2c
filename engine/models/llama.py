"""Our Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in plain PyTorch.

Works on a flattened varlen batch: ``T`` tokens from any number of sequences,
each with its position, attending through the paged KV cache. Weights are
fused at load time (one q/k/v matmul, one gate/up matmul). The module is built
on the ``meta`` device and receives its tensors from :mod:`tokenrelay.engine.models.weights`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokenrelay.engine.attention.metadata import AttentionMetadata, paged_attention
from tokenrelay.engine.kernels import cpu_linear
from tokenrelay.engine.kernels.decoder import FusedDecoder, LayerWeights, Shape, decoder_library
from tokenrelay.engine.kernels.quant import QuantStack, QuantWeight
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.rope import RotaryEmbedding
from tokenrelay.engine.runner.kv_cache import KVCache


class Collectives(Protocol):
    """What a tensor-parallel model needs of its process group (engine/parallel/group.py)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        ...

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Each rank's ``[N, Vp]`` vocabulary shard -> ``[N, vocab_size]``."""
        ...


class QuantRows(Protocol):
    """An embedding table kept quantized: dequantizes only the rows looked up."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` ``[T]`` -> fp32 rows ``[T, hidden]``."""
        ...


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape), requires_grad=False)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps
        self.shape = (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        # half precision: normalise in fp32, scale in the model dtype (as transformers)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention with fused q/k/v, optional bias (Qwen2) and q/k norm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, cfg.hidden_size)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size) if cfg.qkv_bias else None
        self.o_weight = _param(cfg.hidden_size, self.q_size)
        self.o_bias = _param(cfg.hidden_size) if cfg.o_bias else None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.qkv_packed: cpu_linear.Prepared | None = None  # set by CausalLM.pack_linears()
        self.o_packed: cpu_linear.Prepared | None = None
        self.tp: Collectives | None = None  # row-parallel o: sum the ranks' partial outputs

    def pack(self) -> None:
        """Move the q/k/v and output projections to oneDNN's layout (frees the dense ones)."""
        self.qkv_packed = cpu_linear.pack(self.qkv_weight)
        self.o_packed = cpu_linear.pack(self.o_weight)
        self.qkv_weight = cpu_linear.placeholder(self.qkv_weight)
        self.o_weight = cpu_linear.placeholder(self.o_weight)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        t = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = cpu_linear.linear(x, self.qkv_weight, self.qkv_packed, self.qkv_bias)
        # qkv: [T, (H + 2 Hkv) D]
        v = qkv[:, self.q_size + self.kv_size :].view(t, hkv, d)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, : self.q_size].view(t, h, d))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, hkv, d))
            q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        else:
            # rotate q and k in one go: [T, H + Hkv, D]
            qk = rope.apply(qkv[:, : self.q_size + self.kv_size].view(t, h + hkv, d), cos, sin)
            q, k = qk[:, :h], qk[:, h:]
        o = paged_attention(
            q, k, v, kv_cache.k[self.layer_idx], kv_cache.v[self.layer_idx], meta, self.scale
        )  # [T, H, D]
        o2 = o.reshape(t, self.q_size)
        if self.tp is None:
            return cpu_linear.linear(o2, self.o_weight, self.o_packed, self.o_bias)
        return _row_parallel(o2, self.o_weight, self.o_packed, self.o_bias, self.tp)


class MLP(nn.Module):
    """SwiGLU feed-forward with fused gate/up projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_weight = _param(2 * cfg.intermediate_size, cfg.hidden_size)
        self.gate_up_bias = _param(2 * cfg.intermediate_size) if cfg.mlp_bias else None
        self.down_weight = _param(cfg.hidden_size, cfg.intermediate_size)
        self.down_bias = _param(cfg.hidden_size) if cfg.mlp_bias else None
        self.gate_up_packed: cpu_linear.Prepared | None = None  # set by CausalLM.pack_linears()
        self.down_packed: cpu_linear.Prepared | None = None
        self.tp: Collectives | None = None  # row-parallel down: sum the ranks' partial outputs

    def pack(self) -> None:
        """Move both projections to oneDNN's layout (frees the dense ones)."""
        self.gate_up_packed = cpu_linear.pack(self.gate_up_weight)
        self.down_packed = cpu_linear.pack(self.down_weight)
        self.gate_up_weight = cpu_linear.placeholder(self.gate_up_weight)
        self.down_weight = cpu_linear.placeholder(self.down_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = cpu_linear.linear(x, self.gate_up_weight, self.gate_up_packed, self.gate_up_bias)
        gate, up = gate_up[:, : self.inter], gate_up[:, self.inter :]  # [T, I] each
        act = F.silu(gate) * up
        if self.tp is None:
            return cpu_linear.linear(act, self.down_weight, self.down_packed, self.down_bias)
        return _row_parallel(act, self.down_weight, self.down_packed, self.down_bias, self.tp)


def _row_parallel(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: cpu_linear.Prepared | None,
    bias: torch.Tensor | None,
    tp: Collectives,
) -> torch.Tensor:
    """``x`` ``[T, in / size]`` times this rank's input columns, summed over the ranks,
    then the (whole, replicated) bias once: ``[T, out]``, the same on every rank."""
    out = tp.all_reduce(cpu_linear.linear(x, weight, packed))
    return out if bias is None else out + bias


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block with residual connections."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and the (possibly tied) LM head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
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
        self.tp, self.full_vocab = tp, full_vocab
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.attn.tp = layer.mlp.tp = tp

    def fuse(self) -> bool:
        """Run the layers through ``engine/kernels/csrc/decoder.c`` from now on, if it can.

        It can when every projection is a :class:`QuantWeight` or :class:`QuantStack`
        (GGUF weights served as they are), the norms are fp32 and the compiled decoder is
        available (not switched off, a C compiler present). Returns whether the fused path is on.
        """
        library = decoder_library()
        if library is None:
            return False
        cfg = self.cfg
        layers = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.attn, layer.mlp
            qkv, o, gate_up, down = (
                attn.qkv_packed, attn.o_packed, mlp.gate_up_packed, mlp.down_packed
            )  # fmt: skip
            if not (
                isinstance(qkv, QuantWeight | QuantStack)
                and isinstance(o, QuantWeight | QuantStack)
                and isinstance(gate_up, QuantWeight | QuantStack)
                and isinstance(down, QuantWeight | QuantStack)
            ):
                return False
            layers.append(LayerWeights(
                input_norm=layer.input_norm.weight, qkv=qkv, o=o,
                post_norm=layer.post_attn_norm.weight, gate_up=gate_up, down=down,
                qkv_bias=attn.qkv_bias,
                q_norm=None if attn.q_norm is None else attn.q_norm.weight,
                k_norm=None if attn.k_norm is None else attn.k_norm.weight,
                o_bias=attn.o_bias, gate_up_bias=mlp.gate_up_bias, down_bias=mlp.down_bias,
            ))  # fmt: skip
        shape = Shape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.intermediate_size, cfg.rms_norm_eps, cfg.head_dim**-0.5)  # fmt: skip
        head = self.head_packed if isinstance(self.head_packed, QuantWeight) else None
        self.fused = FusedDecoder(library, shape, layers, self.norm.weight, head)
        return True

    def pack_linears(self) -> None:
        """Reorder every projection and the LM head for oneDNN (CPU fp32; kernels/cpu_linear.py).

        The tied embedding keeps its dense copy for the lookup; an untied LM head
        is replaced by its packed copy.
        """
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
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

    def init_rope(self, device: torch.device) -> None:
        """Build the rotary tables on ``device`` (after the weights are loaded)."""
        self.rope = RotaryEmbedding(self.cfg.rope, self.cfg.head_dim, device)

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
        if self.embed_quant is not None:
            x = self.embed_quant.rows(input_ids)  # [T, hidden]
        elif self.tp is not None:
            x = self._parallel_embedding(input_ids, self.tp)  # [T, hidden]
        else:
            x = F.embedding(input_ids, self.embed)  # [T, hidden]
        cos, sin = rope.cos_sin(positions, x.dtype)  # [T, 1, D/2]
        if self.fused is not None:
            if self.fused.kv is not kv_cache.data:
                self.fused.bind_cache(kv_cache.data)
            return self.fused.forward(
                x, cos, sin, meta.slot_mapping, meta.block_tables, meta.seq_of_token,
                meta.row_lens, logits,
            )  # fmt: skip
        if logits is not None:
            raise ValueError("CausalLM: logits within the step need the fused decoder's head")
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            x = x + layer.attn(layer.input_norm(x), cos, sin, rope, meta, kv_cache)
            x = x + layer.mlp(layer.post_attn_norm(x))
        return self.norm(x)

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
        return logits
