"""Paged attention over the KV block pool: metadata, KV writes and two backends.

Backends:

* flash-attn (``flash_attn_varlen_func`` / ``flash_attn_with_kvcache`` with a
  ``block_table``) when ``flash_attn`` imports, the device is CUDA and the block
  size is a multiple of 256 (flash-attn 2's paged-KV requirement);
* a PyTorch path everywhere else. Decode rows (one query token) are batched
  into one ``scaled_dot_product_attention`` call over each sequence's blocks
  gathered into a padded ``[B, Hkv, L, D]`` view; prefill chunks (``q_len > 1``)
  run one call each with a causal mask offset by the cached prefix. Query heads
  that share a KV head are folded into the query-length axis
  (``[Hkv, G * q_len, D]``), so GQA never copies K/V per query head.

Everything that depends only on the batch (slot mapping, block ids to gather,
masks) is built once per step and reused by every layer.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

FLASH_BLOCK_MULTIPLE = 256  # flash-attn 2 needs paged-KV block sizes divisible by this


def flash_attn_available() -> bool:
    """True when the ``flash_attn`` package is importable and CUDA is present."""
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


@dataclass
class DecodePlan:
    """Torch-path plan for the rows with one query token (batched in one call)."""

    token_idx: torch.Tensor | None  # [Bd] int64 rows of the flat batch; None: all rows, in order
    blocks: torch.Tensor  # [Bd * nb] int64 block ids to gather (padded with block 0)
    num_seqs: int
    blocks_per_seq: int  # nb
    mask: torch.Tensor  # [Bd, 1, 1, nb * block_size] additive (0 / -inf)
    k_buf: torch.Tensor | None = None  # [Bd * nb, block_size, Hkv, D] gather scratch, reused
    v_buf: torch.Tensor | None = None


@dataclass
class PrefillPlan:
    """Torch-path plan for one sequence computing a chunk of ``q_len > 1`` tokens."""

    start: int  # rows [start, end) of the flat batch
    end: int
    start_pos: int  # tokens already cached before this chunk
    blocks: torch.Tensor | None  # [nb] int64 blocks holding the context; None: no prefix
    mask_rows: torch.Tensor  # [q_len, ctx] additive causal mask, offset by start_pos
    folded_mask: torch.Tensor | None = None  # [G * q_len, ctx], built on first use


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's flattened varlen batch."""

    positions: torch.Tensor  # [T] int64 position of each token
    slot_mapping: torch.Tensor  # [T] int64 cache slot (block * block_size + offset) to write
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32 tokens in the cache after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_seqlen_q: int
    max_seqlen_k: int
    all_decode: bool
    block_size: int
    use_flash: bool = False
    decode: DecodePlan | None = None
    prefills: list[PrefillPlan] = field(default_factory=list)

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
    dtype: torch.dtype,
    use_flash: bool = False,
) -> AttentionMetadata:
    """Build the step's metadata from per-sequence query lengths, offsets and block tables.

    Shapes: ``B = len(q_lens)``; ``T = sum(q_lens)``. Raises ``ValueError`` when a
    block table is too short for ``start_pos + q_len`` tokens.
    """
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

    all_decode = bool((q == 1).all())
    meta = AttentionMetadata(
        positions=tensor(positions, torch.int64),
        slot_mapping=tensor(slots, torch.int64),
        cu_seqlens_q=tensor(cu_q, torch.int32),
        cu_seqlens_k=tensor(cu_k, torch.int32),
        context_lens=tensor(ctx, torch.int32),
        block_tables=tensor(bt_np, torch.int32),
        max_seqlen_q=int(q.max()),
        max_seqlen_k=int(ctx.max()),
        all_decode=all_decode,
        block_size=block_size,
        use_flash=use_flash,
    )
    if not use_flash:
        _plan_torch(meta, q, starts, ctx, cu_q, bt_np, device, dtype)
    return meta


def _plan_torch(
    meta: AttentionMetadata,
    q: np.ndarray,
    starts: np.ndarray,
    ctx: np.ndarray,
    cu_q: np.ndarray,
    bt_np: np.ndarray,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    bs = meta.block_size
    decode_rows = np.nonzero(q == 1)[0]
    if len(decode_rows):
        d_ctx = ctx[decode_rows]
        nb = int(-(-d_ctx.max() // bs))
        length = nb * bs
        mask = np.where(np.arange(length)[None, :] < d_ctx[:, None], 0.0, -np.inf)
        meta.decode = DecodePlan(
            token_idx=None if meta.all_decode else torch.from_numpy(cu_q[decode_rows]).to(device),
            blocks=torch.from_numpy(np.ascontiguousarray(bt_np[decode_rows, :nb]).ravel()).to(
                device
            ),
            num_seqs=len(decode_rows),
            blocks_per_seq=nb,
            mask=torch.from_numpy(mask).to(device=device, dtype=dtype)[:, None, None, :],
        )
    for i in np.nonzero(q > 1)[0]:
        n, start, c = int(q[i]), int(starts[i]), int(ctx[i])
        cols = torch.arange(c, device=device)
        rows = torch.arange(start, c, device=device)
        mask_rows = torch.zeros((n, c), device=device, dtype=dtype)
        mask_rows.masked_fill_(cols[None, :] > rows[:, None], float("-inf"))
        nb = -(-c // bs)
        blocks = torch.from_numpy(bt_np[i, :nb].copy()).to(device) if start > 0 else None
        meta.prefills.append(PrefillPlan(int(cu_q[i]), int(cu_q[i + 1]), start, blocks, mask_rows))


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write this step's ``k``, ``v`` ``[T, Hkv, D]`` into the pool at ``slots`` ``[T]``."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
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
) -> torch.Tensor:
    """Store ``k``/``v`` ``[T, Hkv, D]`` and attend with ``q`` ``[T, H, D]`` -> ``[T, H, D]``.

    ``k_cache``/``v_cache`` are ``[num_blocks, block_size, Hkv, D]``.
    """
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.use_flash:
        return _flash_attention(q, k_cache, v_cache, meta, scale)
    return _torch_attention(q, k, v, k_cache, v_cache, meta, scale)


def _flash_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    if meta.all_decode:
        out = flash_attn_with_kvcache(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=meta.context_lens,
            block_table=meta.block_tables,
            softmax_scale=scale,
            causal=True,
        )  # [B, 1, H, D]
        return out.squeeze(1)
    return flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=meta.cu_seqlens_q,
        cu_seqlens_k=meta.cu_seqlens_k,
        max_seqlen_q=meta.max_seqlen_q,
        max_seqlen_k=meta.max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        block_table=meta.block_tables,
    )


def _torch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    _, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    groups = num_heads // num_kv_heads
    bs = meta.block_size
    plan = meta.decode
    if plan is not None and plan.token_idx is None:
        return _decode(q, k_cache, v_cache, plan, scale, bs)
    out = q.new_empty(q.shape)
    if plan is not None:
        assert plan.token_idx is not None
        qd = q.index_select(0, plan.token_idx)
        out.index_copy_(0, plan.token_idx, _decode(qd, k_cache, v_cache, plan, scale, bs))
    for p in meta.prefills:
        n = p.end - p.start
        # fold query heads that share a KV head into the row axis: [Hkv, G * n, D]
        qp = q[p.start : p.end].view(n, num_kv_heads, groups, head_dim).permute(1, 2, 0, 3)
        qp = qp.reshape(num_kv_heads, groups * n, head_dim)
        if p.blocks is None:  # no cached prefix: this chunk's own K/V is the whole context
            kp, vp = k[p.start : p.end].transpose(0, 1), v[p.start : p.end].transpose(0, 1)
        else:
            ctx = p.mask_rows.shape[1]
            kp = k_cache.index_select(0, p.blocks).view(-1, num_kv_heads, head_dim)[:ctx]
            vp = v_cache.index_select(0, p.blocks).view(-1, num_kv_heads, head_dim)[:ctx]
            kp, vp = kp.transpose(0, 1), vp.transpose(0, 1)  # [Hkv, ctx, D]
        if p.folded_mask is None:
            p.folded_mask = p.mask_rows.repeat(groups, 1)  # [G * n, ctx], rows ordered (g, i)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.folded_mask, scale=scale)
        # [Hkv, G * n, D] -> [n, H, D]
        out[p.start : p.end] = (
            o.view(num_kv_heads, groups, n, head_dim)
            .permute(2, 0, 1, 3)
            .reshape(n, num_heads, head_dim)
        )
    return out


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """One SDPA call for all single-token rows: ``q`` ``[Bd, H, D]`` -> ``[Bd, H, D]``."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    groups = num_heads // num_kv_heads
    shape = (plan.blocks.shape[0], block_size, num_kv_heads, head_dim)
    if plan.k_buf is None or plan.k_buf.shape != shape or plan.k_buf.dtype != k_cache.dtype:
        plan.k_buf = k_cache.new_empty(shape)
        plan.v_buf = v_cache.new_empty(shape)
    assert plan.v_buf is not None
    torch.index_select(k_cache, 0, plan.blocks, out=plan.k_buf)
    torch.index_select(v_cache, 0, plan.blocks, out=plan.v_buf)
    length = plan.blocks_per_seq * block_size
    kd = plan.k_buf.view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)
    vd = plan.v_buf.view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)
    qd = q.view(num_seqs, num_kv_heads, groups, head_dim)  # G query heads per KV head as rows
    o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.mask, scale=scale)
    return o.reshape(num_seqs, num_heads, head_dim)
