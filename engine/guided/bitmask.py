"""Token bitmasks: allocating them, and applying them to a batch's logits on the device.

A bitmask row holds one bit per token id, packed in int32 words as every grammar
engine writes them (bit ``j % 32`` of word ``j // 32`` is token ``j``; 1 = allowed),
so a 49,152-token vocabulary takes 6 KiB a row. Matchers fill the rows on the host
(:func:`engine.guided.matcher.fill_bitmask`); :func:`apply_bitmask` adds ``-inf`` to
every disallowed logit on the logits' own device, in one batched pass.

The unpacking is a table lookup: the words are read as bytes (little-endian: byte
``k`` of word ``w`` holds tokens ``32w + 8k`` to ``32w + 8k + 7``) and each byte picks
its eight biases (0 or ``-inf``) from a 256 x 8 table in one gather for the whole
batch; the logits then take one in-place add. On a CPU that is faster than xgrammar's
C++ kernel and than a boolean mask through ``masked_fill_`` (``python -m
bench.grammar_choice`` times the first two: docs/benchmarks.md, "Grammar engine for
structured outputs"). The same ops run on CUDA.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F

_BIAS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}  # [256, 8]: 0 or -inf


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int, *, pin: bool = False) -> torch.Tensor:
    """A host ``[rows, words]`` int32 bitmask, every token allowed (all bits set).

    ``pin``: page-locked memory, so the copy to a GPU can overlap (only where CUDA is).
    """
    pin = pin and torch.cuda.is_available()
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)


def _byte_bias(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[256, 8]``: row ``b`` holds 0 for each set bit of byte ``b``, ``-inf`` for each other."""
    table = _BIAS.get((device, dtype))
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = torch.where(bits == 1, 0.0, float("-inf")).to(device=device, dtype=dtype)
        _BIAS[(device, dtype)] = table
    return table


def bitmask_bias(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``[rows, vocab_size]`` of 0 (allowed) or ``-inf`` (banned) on the bitmask's device.

    Tokens past the bitmask's ``32 * words`` (a model vocabulary padded beyond the
    tokenizer's) are banned.
    """
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError("bitmask: expected a 2-D int32 tensor")
    rows, words = bitmask.shape
    covered = min(vocab_size, words * 32)
    if sys.byteorder == "little":
        as_bytes = bitmask.contiguous().view(torch.uint8).view(rows, words * 4).int()
        bias = F.embedding(as_bytes, _byte_bias(bitmask.device, dtype)).view(rows, words * 32)
    else:  # pragma: no cover - no big-endian host runs this engine today
        shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
        bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(rows, words * 32)
        bias = torch.where(bits == 1, 0.0, float("-inf")).to(dtype)
    bias = bias[:, :covered]
    if covered < vocab_size:
        pad = bias.new_full((rows, vocab_size - covered), float("-inf"))
        bias = torch.cat([bias, pad], dim=1)
    return bias


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None
) -> None:
    """Make every token ``bitmask`` bans ``-inf`` in ``logits``, in place.

    ``logits`` ``[N, V]`` float on any device, finite (``+inf`` plus the ban would be
    NaN); ``bitmask`` ``[R, words]`` int32, copied over from the host if need be.
    Bitmask row ``i`` masks logits row ``rows[i]`` (``rows`` None: row ``i``), so
    the unconstrained rows of a mixed batch are left alone.
    """
    if logits.dim() != 2:
        raise ValueError("logits: expected [N, V]")
    count = bitmask.shape[0] if rows is None else len(rows)
    if count == 0:
        return
    if count > bitmask.shape[0] or (rows is None and count > logits.shape[0]):
        raise ValueError("bitmask: fewer rows than asked to apply")
    masks = bitmask[:count].to(logits.device, non_blocking=True)
    bias = bitmask_bias(masks, logits.shape[1], logits.dtype)
    if rows is None:
        logits[:count].add_(bias)
    else:
        index = torch.tensor(list(rows), device=logits.device, dtype=torch.long)
        logits.index_add_(0, index, bias)
