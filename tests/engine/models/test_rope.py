"""Rotary embeddings: the CPU's table of cos/sin gives what computing them gives."""

from __future__ import annotations

import pytest
import torch

from tokenrelay.engine.models.config import RopeConfig
from tokenrelay.engine.models.rope import RotaryEmbedding

ROPES = {
    "default": RopeConfig(theta=10000.0),
    "linear": RopeConfig(theta=10000.0, rope_type="linear", factor=2.0),
    "llama3": RopeConfig(
        theta=500000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=8192
    ),
    "yarn": RopeConfig(
        theta=1e6, rope_type="yarn", factor=4.0, original_max_position_embeddings=128
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("name", sorted(ROPES))
def test_table_rows_equal_computed_ones(name: str, head_dim: int, dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(ROPES[name], head_dim, torch.device("cpu"))
    gen = torch.Generator().manual_seed(head_dim)
    batches = [
        torch.tensor([5]),
        torch.arange(0, 37),  # a prefill chunk
        torch.tensor([300]),  # the table grows
        torch.randint(0, 5000, (9,), generator=gen),  # a decode batch, any order
    ]
    for positions in batches:
        cos, sin = rope.cos_sin(positions, dtype)
        want_cos, want_sin = rope._compute(positions, dtype)
        assert cos.shape == (len(positions), 1, head_dim // 2) and cos.dtype == dtype
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_negative_or_no_positions_are_computed() -> None:
    rope = RotaryEmbedding(ROPES["default"], 64, torch.device("cpu"))
    for positions in (torch.tensor([-3, 4]), torch.zeros(0, dtype=torch.int64)):
        cos, sin = rope.cos_sin(positions, torch.float32)
        want_cos, want_sin = rope._compute(positions, torch.float32)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
