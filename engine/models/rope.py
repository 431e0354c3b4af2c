"""Rotary position embeddings with the checkpoint's scaling (as transformers does).

The frequencies follow ``transformers.modeling_rope_utils`` for the ``default``,
``linear``, ``llama3``, ``yarn`` and ``longrope`` types, and the rotation is the
"rotate half" (non-interleaved) layout that Llama/Qwen checkpoints use. With a
``partial_rotary_factor`` below 1 (Phi-4-mini) only the first
``int(head_dim * partial_rotary_factor)`` values of each head rotate; the rest pass through.

``longrope`` (Phi-3, ``su`` in older configs) divides each frequency by a per-dimension
factor, the ``short_factor`` list or the ``long_factor`` one, and scales cos/sin by
``sqrt(1 + log(factor) / log(original_max_position_embeddings))``. transformers picks the
list by the running sequence's length (its ``generate`` drops the cache and recomputes
everything with the long list once a sequence outgrows the original context); a paged
cache shared between sequences cannot hold keys rotated both ways, so the engine picks
one list for every sequence from the context it serves (``context_len``): the long one
when it exceeds ``original_max_position_embeddings``, as vLLM and llama.cpp do.
"""

from __future__ import annotations

import math

import torch

from tokenrelay.engine.models.config import RopeConfig


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """How many values of each head rotate (all of them unless ``partial_rotary_factor``)."""
    return int(head_dim * rope.partial_rotary_factor)


def rope_inv_freq(
    rope: RopeConfig, head_dim: int, context_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rotary_dim // 2]`` (fp32) and the cos/sin scaling factor.

    ``context_len``: the longest sequence served (``longrope`` only: past the original
    context, the long factors; None: the short ones).
    """
    dim = rotary_dim(rope, head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    pos_freqs = rope.theta**exponents
    inv_freq = 1.0 / pos_freqs
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(pos_freqs, rope, dim)
    if rope.rope_type == "longrope":
        return _longrope(pos_freqs, rope, context_len)
    raise ValueError(f"rope_scaling.rope_type: {rope.rope_type!r} is not supported")


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    factor = rope.factor
    old_len = rope.original_max_position_embeddings or 8192
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(pos_freqs: torch.Tensor, rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    factor = rope.factor
    base = rope.theta
    orig = rope.original_max_position_embeddings or 4096

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def long_factors(rope: RopeConfig, context_len: int | None) -> bool:
    """Whether ``longrope`` serving ``context_len`` tokens takes the long factor list."""
    orig = rope.original_max_position_embeddings
    return context_len is not None and orig is not None and context_len > orig


def _longrope(
    pos_freqs: torch.Tensor, rope: RopeConfig, context_len: int | None
) -> tuple[torch.Tensor, float]:
    """transformers' ``_compute_longrope_parameters``: one factor list for every position."""
    orig = rope.original_max_position_embeddings
    assert orig is not None and rope.short_factor is not None and rope.long_factor is not None
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = rope.long_factor if long_factors(rope, context_len) else rope.short_factor
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * pos_freqs), float(attention_factor)


class RotaryEmbedding:
    """Computes cos/sin for given positions and rotates q and k in place of a copy."""

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        device: torch.device,
        context_len: int | None = None,
    ) -> None:
        inv_freq, scale = rope_inv_freq(rope, head_dim, context_len)
        self.inv_freq = inv_freq.to(device)  # [R/2] fp32 (R: the rotated values of a head)
        self.scale = scale
        self.rotary_dim = rotary_dim(rope, head_dim)
        self.partial = self.rotary_dim != head_dim
        self.half = self.rotary_dim // 2
        # longrope: whether the tables use the long factor list (else the short one)
        self.long_factors = rope.rope_type == "longrope" and long_factors(rope, context_len)
        # CPU: cos and sin [P, 1, D/2] fp32 of positions 0 .. P-1, grown on demand
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``cos, sin`` of shape ``[T, 1, R/2]`` in ``dtype`` (computed in fp32).

        On a CPU the rows come from a table of the same values, computed once: two
        lookups instead of eight small ops a step (a GPU computes them: no sync).
        """
        if positions.device.type == "cpu" and positions.numel():
            lo, hi = (int(v) for v in positions.aminmax())
            if lo >= 0:
                cos, sin = self._rows(hi + 1)
                cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
                return (cos, sin) if dtype == torch.float32 else (cos.to(dtype), sin.to(dtype))
        return self._compute(positions, dtype)

    def _rows(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The table, grown (doubling) to hold at least ``count`` positions."""
        table = self._table
        if table is None or table[0].shape[0] < count:
            size = max(count, 2 * table[0].shape[0] if table is not None else 256)
            table = self._table = self._compute(torch.arange(size), torch.float32)
        return table

    def _compute(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, D]`` (any strides) and return a new contiguous tensor
        (only its first ``rotary_dim`` values where the rotation is partial)."""
        if self.partial:
            rot = x[..., : self.rotary_dim]
            x1, x2 = rot[..., : self.half], rot[..., self.half :]
            rest = x[..., self.rotary_dim :]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
        x1, x2 = x[..., : self.half], x[..., self.half :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
