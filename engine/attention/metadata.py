"""The step's attention metadata, built once per step and read by every layer.

Everything that depends only on the batch (positions, the slot each new token's
K/V goes to, block tables, sequence offsets) is computed here once; a backend
that needs more (the torch path's gather plans) adds its plan through
:meth:`AttentionBackend.plan`. Two builders give the same result: a general one
(numpy, any mix of prefill chunks and decode rows) and a faster one for batches
of single-token rows (Python ints: the per-token cost of a decode step).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from tokenrelay.engine.attention.backend import AttentionBackend, HostBatch


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's flattened varlen batch."""

    positions: torch.Tensor  # [T] int64 position of each token
    slot_mapping: torch.Tensor  # [T] int64 cache slot (block * block_size + offset) to write
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32 tokens in the cache after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    seq_of_token: torch.Tensor  # [T] int64 each token's sequence (row of block_tables)
    row_lens: torch.Tensor  # [T] int32 tokens each token attends to (its position + 1)
    max_seqlen_q: int
    max_seqlen_k: int
    all_decode: bool
    block_size: int
    backend: AttentionBackend
    plan: object | None = None  # the backend's own per-step plan, if it makes one

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def build_metadata(
    q_lens: list[int],
    start_positions: list[int],
    block_tables: list[list[int]],
    *,
    block_size: int,
    device: torch.device,
    backend: AttentionBackend,
    plan: bool = True,
) -> AttentionMetadata:
    """Build the step's metadata from per-sequence query lengths, offsets and block tables.

    Shapes: ``B = len(q_lens)``; ``T = sum(q_lens)``. Raises ``ValueError`` when a
    block table is too short for ``start_pos + q_len`` tokens. ``plan=False`` skips
    the backend's plan (the fused CPU decoder reads only the tensors).
    """
    if q_lens and q_lens.count(1) == len(q_lens) and min(start_positions) >= 0:
        meta, host = _build_decode(start_positions, block_tables, block_size, device, backend)
    else:
        meta, host = _build_general(q_lens, start_positions, block_tables, block_size, device,
                                    backend)  # fmt: skip
    if plan and backend.needs_plan:
        backend.plan(meta, host())
    return meta


class _Host:
    """The host arrays of a batch, made only if a backend asks for them."""

    def __init__(self, make: HostBatch | None = None, **lists: list[int]) -> None:
        self._made = make
        self._lists = lists

    def __call__(self) -> HostBatch:
        if self._made is None:
            starts = np.asarray(self._lists["starts"], dtype=np.int64)
            num = len(starts)
            self._made = HostBatch(
                q_lens=np.ones(num, dtype=np.int64),
                starts=starts,
                ctx=starts + 1,
                cu_q=np.arange(num + 1, dtype=np.int64),
                block_tables=np.array(self._lists["padded"], dtype=np.int64).reshape(num, -1),
            )
        return self._made


def _build_general(
    q_lens: list[int],
    start_positions: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    backend: AttentionBackend,
) -> tuple[AttentionMetadata, _Host]:
    """:func:`build_metadata` of any batch (prefill chunks and decode rows), with numpy."""
    num_seqs = len(q_lens)
    q = np.asarray(q_lens, dtype=np.int64)
    starts = np.asarray(start_positions, dtype=np.int64)
    ctx = starts + q
    max_blocks = max(len(bt) for bt in block_tables)
    bt_np = np.zeros((num_seqs, max(max_blocks, 1)), dtype=np.int64)
    for i, bt in enumerate(block_tables):
        if len(bt) * block_size < ctx[i]:
            raise ValueError(
                f"block_table: {len(bt)} blocks of {block_size} cannot hold {int(ctx[i])} tokens"
            )
        bt_np[i, : len(bt)] = bt
    cu_q = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q, out=cu_q[1:])
    cu_k = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(ctx, out=cu_k[1:])
    total = int(cu_q[-1])
    seq_of_token = np.repeat(np.arange(num_seqs), q)  # [T]
    positions = np.arange(total, dtype=np.int64) - np.repeat(cu_q[:-1] - starts, q)
    slots = bt_np[seq_of_token, positions // block_size] * block_size + positions % block_size

    def tensor(a: np.ndarray, dt: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=device, dtype=dt, non_blocking=True)

    meta = AttentionMetadata(
        positions=tensor(positions, torch.int64),
        slot_mapping=tensor(slots, torch.int64),
        cu_seqlens_q=tensor(cu_q, torch.int32),
        cu_seqlens_k=tensor(cu_k, torch.int32),
        context_lens=tensor(ctx, torch.int32),
        block_tables=tensor(bt_np, torch.int32),
        seq_of_token=tensor(seq_of_token, torch.int64),
        row_lens=tensor(positions + 1, torch.int32),
        max_seqlen_q=int(q.max()),
        max_seqlen_k=int(ctx.max()),
        all_decode=bool((q == 1).all()),
        block_size=block_size,
        backend=backend,
    )
    return meta, _Host(HostBatch(q, starts, ctx, cu_q, bt_np))


def _build_decode(
    starts: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    backend: AttentionBackend,
) -> tuple[AttentionMetadata, _Host]:
    """:func:`build_metadata` of a batch of single-token rows, from Python ints.

    The same tensors as the general path, without its dozen numpy calls on tiny
    arrays: the per-token cost of a decode step, most of all at batch 1.
    """
    num_seqs = len(starts)
    width = max(len(bt) for bt in block_tables)
    slots: list[int] = []
    padded: list[int] = []  # the block tables, row by row, padded with 0 to ``width``
    for pos, bt in zip(starts, block_tables, strict=True):
        if len(bt) * block_size <= pos:
            raise ValueError(
                f"block_table: {len(bt)} blocks of {block_size} cannot hold {pos + 1} tokens"
            )
        slots.append(bt[pos // block_size] * block_size + pos % block_size)
        padded += bt
        if len(bt) < width:
            padded += [0] * (width - len(bt))
    ctx = [pos + 1 for pos in starts]

    def tensor(values: list[int], dt: type[np.signedinteger]) -> torch.Tensor:
        return torch.from_numpy(np.array(values, dtype=dt)).to(device, non_blocking=True)

    meta = AttentionMetadata(
        positions=tensor(starts, np.int64),
        slot_mapping=tensor(slots, np.int64),
        cu_seqlens_q=tensor(list(range(num_seqs + 1)), np.int32),
        cu_seqlens_k=tensor([0, *accumulate(ctx)], np.int32),
        context_lens=tensor(ctx, np.int32),
        block_tables=tensor(padded, np.int32).view(num_seqs, width),
        seq_of_token=tensor(list(range(num_seqs)), np.int64),
        row_lens=tensor(ctx, np.int32),
        max_seqlen_q=1,
        max_seqlen_k=max(ctx),
        all_decode=True,
        block_size=block_size,
        backend=backend,
    )
    return meta, _Host(starts=starts, padded=padded)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write this step's ``k``, ``v`` ``[T, Hkv, D]`` into the pool at ``slots`` ``[T]``
    (rounded to the pool's dtype where it is narrower than theirs)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if k_cache.dtype != k.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Store ``k``/``v`` ``[T, Hkv, D]`` and attend with ``q`` ``[T, H, D]`` -> ``[T, H, D]``.

    ``k_cache``/``v_cache`` are ``[num_blocks, block_size, Hkv, D]``; ``window`` and
    ``softcap`` as :meth:`AttentionBackend.forward` takes them (a layer's own).
    """
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return meta.backend.forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
