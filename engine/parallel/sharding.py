"""One tensor-parallel rank's share of a checkpoint (see :mod:`tokenrelay.engine.parallel.layout`).

Works on the state dict :func:`engine.models.weights.load_model` builds, under our
module's names, after q/k/v and gate/up were fused (rows ``[q; k; v]`` and
``[gate; up]``): each fused tensor is cut part by part, so a rank's fused tensor is
``[q_r; k_r; v_r]`` / ``[gate_r; up_r]``.
"""

from __future__ import annotations

import re

import torch

from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.parallel.layout import vocab_shard

_LAYER = re.compile(r"^layers\.\d+\.(.+)$")


def _rows(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s equal share of the rows (dim 0) of ``t``."""
    n = t.shape[0] // size
    return t[rank * n : (rank + 1) * n]


def shard_qkv(t: torch.Tensor, cfg: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """``[(H + 2 Hkv) D, ...]`` -> this rank's ``[(H + 2 Hkv) D / size, ...]`` (column-parallel)."""
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, k, v = t.split([q_size, kv_size, kv_size], dim=0)
    return torch.cat([_rows(q, rank, size), _rows(k, rank, size), _rows(v, rank, size)])


def shard_gate_up(t: torch.Tensor, cfg: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """``[2 I, ...]`` -> this rank's ``[2 I / size, ...]`` (column-parallel)."""
    gate, up = t.split([cfg.intermediate_size, cfg.intermediate_size], dim=0)
    return torch.cat([_rows(gate, rank, size), _rows(up, rank, size)])


def shard_columns(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """``[out, in]`` -> ``[out, in / size]``: the input features this rank multiplies
    (row-parallel o and down; the partial outputs are summed by an all-reduce)."""
    n = t.shape[1] // size
    return t[:, rank * n : (rank + 1) * n]


def shard_vocab(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """``[V, E]`` -> rows ``[r Vp, (r+1) Vp)``, ``Vp = ceil(V / size)``, zero rows past ``V``."""
    per = vocab_shard(t.shape[0], size)
    part = t[rank * per : (rank + 1) * per]
    if part.shape[0] == per:
        return part
    pad = t.new_zeros((per - part.shape[0], *t.shape[1:]))
    return torch.cat([part, pad])


def shard_state(
    state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, size: int
) -> dict[str, torch.Tensor]:
    """Every tensor of a full model's ``state`` (our names) cut to rank ``rank`` of ``size``.

    ``cfg`` is the full model's config. Norms and the biases added after a reduction
    (o, down) are kept whole, but for q/k norms over the whole projections (OLMo 2):
    each rank holds the part of their weights that scales its heads.
    """
    if size == 1:
        return dict(state)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _LAYER.match(name)
        local = m.group(1) if m else name
        if local in ("attn.qkv_weight", "attn.qkv_bias"):
            out[name] = shard_qkv(t, cfg, rank, size)
        elif local in ("mlp.gate_up_weight", "mlp.gate_up_bias"):
            out[name] = shard_gate_up(t, cfg, rank, size)
        elif local in ("attn.o_weight", "mlp.down_weight"):
            out[name] = shard_columns(t, rank, size)
        elif local in ("embed", "lm_head"):
            out[name] = shard_vocab(t, rank, size)
        elif cfg.qk_norm_full and local in ("attn.q_norm.weight", "attn.k_norm.weight"):
            out[name] = _rows(t, rank, size)  # OLMo 2: the weights of this rank's heads
        else:  # norms, o/down biases: replicated
            out[name] = t
    return out
