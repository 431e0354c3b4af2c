"""engine/guided/bitmask.py against a bit-by-bit reference: rows, padding, dtypes."""

from __future__ import annotations

import pytest
import torch

from tokenrelay.engine.guided.bitmask import (
    allocate_bitmask,
    apply_bitmask,
    bitmask_bias,
    bitmask_words,
)


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, bitmask_words(vocab))
    return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=gen)


def reference_banned(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """True where token ``j``'s bit (bit ``j % 32`` of word ``j // 32``) is 0."""
    out = torch.ones(bitmask.shape[0], vocab, dtype=torch.bool)
    for r in range(bitmask.shape[0]):
        for j in range(min(vocab, bitmask.shape[1] * 32)):
            word = int(bitmask[r, j // 32]) & 0xFFFFFFFF
            out[r, j] = not (word >> (j % 32)) & 1
    return out


def test_allocate_allows_everything() -> None:
    mask = allocate_bitmask(3, 49152)
    assert mask.shape == (3, 1536) and mask.dtype == torch.int32
    assert bool((mask == -1).all())
    assert bitmask_words(1) == 1 and bitmask_words(32) == 1 and bitmask_words(33) == 2


@pytest.mark.parametrize("vocab", [1, 31, 32, 100, 257])
def test_apply_matches_the_bit_by_bit_reference(vocab: int) -> None:
    bitmask = random_bitmask(4, vocab, seed=vocab)
    logits = torch.randn(4, vocab)
    out = logits.clone()
    apply_bitmask(out, bitmask)
    banned = reference_banned(bitmask, vocab)
    assert torch.equal(out, logits.masked_fill(banned, float("-inf")))


def test_rows_map_bitmask_rows_to_logits_rows() -> None:
    vocab = 70
    bitmask = random_bitmask(2, vocab, seed=1)
    logits = torch.randn(5, vocab)
    out = logits.clone()
    apply_bitmask(out, bitmask, rows=[3, 0])
    banned = reference_banned(bitmask, vocab)
    expect = logits.clone()
    expect[3] = expect[3].masked_fill(banned[0], float("-inf"))
    expect[0] = expect[0].masked_fill(banned[1], float("-inf"))
    assert torch.equal(out, expect)  # rows 1, 2 and 4 untouched
    apply_bitmask(out, bitmask, rows=[])
    assert torch.equal(out, expect)


def test_a_padded_vocabulary_bans_the_padding() -> None:
    bitmask = torch.full((1, 1), -1, dtype=torch.int32)  # tokens 0..31 allowed
    logits = torch.zeros(1, 40)
    apply_bitmask(logits, bitmask)
    assert bool((logits[0, :32] == 0).all()) and bool(torch.isinf(logits[0, 32:]).all())


def test_a_wider_bitmask_is_cut_to_the_logits() -> None:
    bitmask = torch.zeros((1, 4), dtype=torch.int32)
    bitmask[0, 0] = 0b101
    logits = torch.zeros(1, 3)
    apply_bitmask(logits, bitmask)
    assert logits.tolist() == [[0.0, float("-inf"), 0.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes(dtype: torch.dtype) -> None:
    bitmask = random_bitmask(2, 64, seed=7)
    logits = torch.randn(2, 64).to(dtype)
    apply_bitmask(logits, bitmask)
    assert logits.dtype == dtype
    assert torch.equal(torch.isinf(logits), reference_banned(bitmask, 64))
    assert bitmask_bias(bitmask, 64, dtype).dtype == dtype


def test_the_full_vocabulary_at_batch_64() -> None:
    vocab = 49152
    bitmask = random_bitmask(64, vocab, seed=3)
    logits = torch.randn(64, vocab)
    out = logits.clone()
    apply_bitmask(out, bitmask)
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(64, -1)[:, :vocab].bool()
    assert torch.equal(out, logits.masked_fill(~allowed, float("-inf")))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="logits"):
        apply_bitmask(torch.zeros(3), torch.zeros((1, 1), dtype=torch.int32))
    with pytest.raises(ValueError, match="fewer rows"):
        apply_bitmask(torch.zeros(2, 3), torch.zeros((1, 1), dtype=torch.int32), rows=[0, 1])
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask(torch.zeros(1, 3), torch.zeros((1, 1), dtype=torch.int64))
