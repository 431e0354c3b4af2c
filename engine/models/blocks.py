"""Building blocks the decoder families share: norms, the gated MLP, attention projections.

Each family module (``llama.py``, ``granite.py``, ``olmo2.py``, ``gemma.py``, ...)
assembles its layers from these; what differs between families (where the norms sit,
scalar multipliers, how q and k are normalised, Gemma's ``1 + weight`` norms and GeGLU)
lives in the family's module as a small override, not a copy.

Every projection is one dense weight that :func:`cpu_linear.pack` may move into oneDNN's
layout (CPU fp32), or a quantized one set by the GGUF loader; under tensor parallelism
the row-parallel ones (attention output, MLP down) sum the ranks' partial outputs, and
:func:`split_rms_norms` normalises vectors whose values are split over the ranks.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokenrelay.engine.kernels import cpu_linear
from tokenrelay.engine.models.config import ModelConfig


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


def param(*shape: int) -> nn.Parameter:
    """An uninitialised frozen parameter (built on ``meta``, assigned by the loaders)."""
    return nn.Parameter(torch.empty(shape), requires_grad=False)


def row_parallel(
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


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension.

    In half precision the statistics are always fp32; the two variants differ in where
    the weight multiplies: Llama's family scales the normalised value cast back to the
    model dtype, OLMo's (``scale_in_fp32``) scales in fp32 and casts the product, each as
    transformers does. In fp32 both are the same.
    """

    def __init__(self, dim: int, eps: float, *, scale_in_fp32: bool = False) -> None:
        super().__init__()
        self.weight = param(dim)
        self.eps = eps
        self.shape = (dim,)
        self.scale_in_fp32 = scale_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_fp32:
            return (self.weight * xf).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def scaled(self, x: torch.Tensor, mean_sq: torch.Tensor) -> torch.Tensor:
        """``x`` divided by the root of ``mean_sq`` (fp32, ``[..., 1]``, computed elsewhere)
        plus eps, then scaled by the weight and cast as :meth:`forward` does."""
        xf = x.float() * torch.rsqrt(mean_sq + self.eps)
        if self.scale_in_fp32 or x.dtype == torch.float32:
            return (self.weight * xf).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def split_rms_norms(
    parts: list[tuple[RMSNorm, torch.Tensor]], tp: Collectives
) -> list[torch.Tensor]:
    """RMSNorms of vectors split over the ranks (OLMo 2's q/k norms under tensor parallelism).

    Each ``(norm, x)``: ``x`` ``[T, n / size]`` is this rank's slice of every token's ``n``
    values and ``norm`` holds the same slice of the weight. One all-reduce sums the
    per-token sums of squares of all parts (``[T, len(parts)]``); each rank then normalises
    its slice by the whole vector's mean: the one-rank norm, up to the order of the sums.
    """
    sums = torch.stack([x.float().pow(2).sum(-1) for _, x in parts], dim=-1)  # [T, P]
    tp.all_reduce(sums)
    return [
        norm.scaled(x, sums[:, i : i + 1] / (x.shape[-1] * tp.size))
        for i, (norm, x) in enumerate(parts)
    ]


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scaled by ``1 + weight`` (checkpoints store the offset from 1), in
    fp32 and cast back, as transformers' ``Gemma2RMSNorm`` / ``Gemma3RMSNorm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, scale, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * scale).to(x.dtype)

    def scaled(self, x: torch.Tensor, mean_sq: torch.Tensor) -> torch.Tensor:
        xf = x.float() * torch.rsqrt(mean_sq + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedMLP(nn.Module):
    """SwiGLU feed-forward ``down(silu(gate(x)) * up(x))`` with a fused gate/up projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_weight = param(2 * cfg.intermediate_size, cfg.hidden_size)
        self.gate_up_bias = param(2 * cfg.intermediate_size) if cfg.mlp_bias else None
        self.down_weight = param(cfg.hidden_size, cfg.intermediate_size)
        self.down_bias = param(cfg.hidden_size) if cfg.mlp_bias else None
        self.gate_up_packed: cpu_linear.Prepared | None = None  # set by pack() or GGUF
        self.down_packed: cpu_linear.Prepared | None = None
        self.tp: Collectives | None = None  # row-parallel down: sum the ranks' partial outputs

    def pack(self) -> None:
        """Move both projections to oneDNN's layout (frees the dense ones)."""
        self.gate_up_packed = cpu_linear.pack(self.gate_up_weight)
        self.down_packed = cpu_linear.pack(self.down_weight)
        self.gate_up_weight = cpu_linear.placeholder(self.gate_up_weight)
        self.down_weight = cpu_linear.placeholder(self.down_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``."""
        gate_up = cpu_linear.linear(x, self.gate_up_weight, self.gate_up_packed, self.gate_up_bias)
        gate, up = gate_up[:, : self.inter], gate_up[:, self.inter :]  # [T, I] each
        act = self.activation(gate) * up
        if self.tp is None:
            return cpu_linear.linear(act, self.down_weight, self.down_packed, self.down_bias)
        return row_parallel(act, self.down_weight, self.down_packed, self.down_bias, self.tp)

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        """The gate's nonlinearity (a family's hook): SiLU."""
        return F.silu(gate)


class GeGLUMLP(GatedMLP):
    """GeGLU ``down(gelu_tanh(gate(x)) * up(x))``: Gemma's ``gelu_pytorch_tanh``."""

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")


class AttentionProjections(nn.Module):
    """The fused q/k/v projection and the output projection of a GQA attention layer,
    each with an optional bias (Qwen2's on q/k/v only; Llama/Granite/OLMo's
    ``attention_bias`` on all four)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_weight = param(self.q_size + 2 * self.kv_size, cfg.hidden_size)
        self.qkv_bias = param(self.q_size + 2 * self.kv_size) if cfg.qkv_bias else None
        self.o_weight = param(cfg.hidden_size, self.q_size)
        self.o_bias = param(cfg.hidden_size) if cfg.o_bias else None
        self.qkv_packed: cpu_linear.Prepared | None = None  # set by pack() or GGUF
        self.o_packed: cpu_linear.Prepared | None = None
        self.tp: Collectives | None = None  # row-parallel o: sum the ranks' partial outputs

    def pack(self) -> None:
        """Move the q/k/v and output projections to oneDNN's layout (frees the dense ones)."""
        self.qkv_packed = cpu_linear.pack(self.qkv_weight)
        self.o_packed = cpu_linear.pack(self.o_weight)
        self.qkv_weight = cpu_linear.placeholder(self.qkv_weight)
        self.o_weight = cpu_linear.placeholder(self.o_weight)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, (H + 2 Hkv) D]``: q, then k, then v."""
        return cpu_linear.linear(x, self.qkv_weight, self.qkv_packed, self.qkv_bias)

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """The attention output ``[T, H D]`` -> ``[T, hidden]`` (summed over the ranks)."""
        if self.tp is None:
            return cpu_linear.linear(o, self.o_weight, self.o_packed, self.o_bias)
        return row_parallel(o, self.o_weight, self.o_packed, self.o_bias, self.tp)
