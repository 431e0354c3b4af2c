"""Paged attention over the KV block pool: metadata, KV writes and two backends.

Backends:

* flash-attn (``flash_attn_varlen_func`` / ``flash_attn_with_kvcache`` with a
  ``block_table``) when ``flash_attn`` imports, the device is CUDA and the block
  size is a multiple of 256 (flash-attn 2's paged-KV requirement);
* on a CPU in fp32, decode rows (one query token) go to the compiled kernel of
  :mod:`engine.kernels.cpu_attention`, which reads K and V out of the blocks in place, when it
  built;
* a PyTorch path everywhere else. Decode rows (one query token) are sorted by
  context length into buckets; each bucket is one
  ``scaled_dot_product_attention`` call over its sequences' blocks gathered into
  a padded ``[B, Hkv, L, D]`` view (bucketing keeps the padding small when
  lengths are ragged). On a CPU a bucket holds at most
  ``CPU_DECODE_BUCKET_ROWS`` rows, so its gathered K/V (a few MB) is still in
  cache when SDPA reads it; on a GPU there are at most ``DECODE_MAX_BUCKETS``.
  Query heads that share a KV head are folded into the query axis
  (``[B, Hkv, G, D]``), so GQA never copies K/V per query head.
  Prefill chunks (``q_len > 1``) run one call each: ``is_causal`` without a
  cached prefix, else a causal mask offset by the prefix length.

Everything that depends only on the batch (slot mapping, block ids to gather,
masks) is built once per step and reused by every layer; the gather buffers
come from a grow-only :class:`AttentionScratch` the runner keeps across steps.

Long: the step's metadata (a general builder, and a faster one for decode-only
batches that must give the same result) and the backends share the plan types
defined here; the metadata moves to a module of its own with the attention-backend
registry of the GPU work (issue 18).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.kernels.cpu_attention import DecodeBatch, PagedDecode

FLASH_BLOCK_MULTIPLE = 256  # flash-attn 2 needs paged-KV block sizes divisible by this
DECODE_BUCKET_MIN = 8  # at least this many rows per decode bucket
DECODE_MAX_BUCKETS = 4
# CPU: rows per decode bucket. 8 rows x ~500 tokens of K and V is ~5 MB, which stays in
# cache between the gather and SDPA; one bucket of 64 rows goes out to memory and back
# (bench/engine_profile.py buckets; docs/benchmarks.md).
CPU_DECODE_BUCKET_ROWS = 8


def flash_attn_available() -> bool:
    """True when the ``flash_attn`` package is importable and CUDA is present."""
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


class AttentionScratch:
    """A grow-only flat buffer for the decode gathers, reused across layers and steps."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of ``numel`` elements (contents undefined)."""
        buf = self._buf
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            size = max(numel, int(buf.numel() * 1.25) if buf is not None else 0)
            buf = self._buf = torch.empty(size, dtype=dtype, device=device)
        return buf[:numel]


@dataclass
class DecodePlan:
    """Torch-path plan for one bucket of rows with a single query token."""

    token_idx: torch.Tensor  # [Bd] int64 rows of the flat batch
    blocks: torch.Tensor  # [Bd * nb] int64 block ids to gather (padded with block 0)
    num_seqs: int
    blocks_per_seq: int  # nb
    mask: torch.Tensor  # [Bd, 1, 1, nb * block_size] additive (0 / -inf)
    identity: bool = False  # token_idx == arange(T): the whole batch, in order


@dataclass
class PrefillPlan:
    """Torch-path plan for one sequence computing a chunk of ``q_len > 1`` tokens."""

    start: int  # rows [start, end) of the flat batch
    end: int
    start_pos: int  # tokens already cached before this chunk
    blocks: torch.Tensor | None  # [nb] int64 blocks holding the context; None: no prefix
    mask: torch.Tensor | None  # [q_len, ctx] additive causal mask offset by start_pos


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
    use_flash: bool = False
    decode: list[DecodePlan] = field(default_factory=list)
    # the compiled CPU decode kernel, and this step's decode rows checked for it
    decode_kernel: PagedDecode | None = None
    kernel_batch: DecodeBatch | None = None
    prefills: list[PrefillPlan] = field(default_factory=list)
    scratch: AttentionScratch = field(default_factory=AttentionScratch)

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
    scratch: AttentionScratch | None = None,
    decode_kernel: PagedDecode | None = None,
    plan: bool = True,
) -> AttentionMetadata:
    """Build the step's metadata from per-sequence query lengths, offsets and block tables.

    Shapes: ``B = len(q_lens)``; ``T = sum(q_lens)``. Raises ``ValueError`` when a
    block table is too short for ``start_pos + q_len`` tokens. ``decode_kernel``
    (for fp32 on a CPU) takes the decode rows instead of the torch buckets.
    ``plan=False`` skips the per-backend plans (the fused decoder reads only the tensors).
    """
    if q_lens and q_lens.count(1) == len(q_lens) and min(start_positions) >= 0:
        return _build_decode(
            start_positions,
            block_tables,
            block_size=block_size,
            device=device,
            dtype=dtype,
            use_flash=use_flash,
            scratch=scratch,
            decode_kernel=decode_kernel,
            plan=plan,
        )
    return _build_general(
        q_lens,
        start_positions,
        block_tables,
        block_size=block_size,
        device=device,
        dtype=dtype,
        use_flash=use_flash,
        scratch=scratch,
        decode_kernel=decode_kernel,
        plan=plan,
    )


def _build_general(
    q_lens: list[int],
    start_positions: list[int],
    block_tables: list[list[int]],
    *,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    use_flash: bool,
    scratch: AttentionScratch | None,
    decode_kernel: PagedDecode | None,
    plan: bool,
) -> AttentionMetadata:
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
        use_flash=use_flash,
        scratch=scratch or AttentionScratch(),
        decode_kernel=decode_kernel,
    )
    if plan and not use_flash:
        _plan_decode(meta, q, ctx, cu_q, bt_np, device, dtype)
        _plan_prefill(meta, q, starts, ctx, cu_q, bt_np, device, dtype)
    return meta


def _build_decode(
    starts: list[int],
    block_tables: list[list[int]],
    *,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    use_flash: bool,
    scratch: AttentionScratch | None,
    decode_kernel: PagedDecode | None,
    plan: bool,
) -> AttentionMetadata:
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
        use_flash=use_flash,
        scratch=scratch or AttentionScratch(),
        decode_kernel=decode_kernel,
    )
    if plan and not use_flash:  # no prefill rows to plan
        bt_np = np.array(padded, dtype=np.int64).reshape(num_seqs, width)
        q = np.ones(num_seqs, dtype=np.int64)
        cu_q = np.arange(num_seqs + 1, dtype=np.int64)
        _plan_decode(meta, q, np.array(ctx, dtype=np.int64), cu_q, bt_np, device, dtype)
    return meta


def _plan_decode(
    meta: AttentionMetadata,
    q: np.ndarray,
    ctx: np.ndarray,
    cu_q: np.ndarray,
    bt_np: np.ndarray,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Bucket single-token rows by context length (sorted, equal-sized buckets)."""
    rows = np.nonzero(q == 1)[0]
    if not len(rows):
        return
    if meta.decode_kernel is not None:  # one call per layer for every decode row, in place
        meta.kernel_batch = meta.decode_kernel.plan(
            meta.block_tables,
            meta.context_lens,
            torch.from_numpy(cu_q[rows]),
            torch.from_numpy(rows.astype(np.int64)),
            meta.block_size,
        )
        return
    rows = rows[np.argsort(ctx[rows], kind="stable")]
    if device.type == "cpu":
        buckets = -(-len(rows) // CPU_DECODE_BUCKET_ROWS)
    else:
        buckets = max(1, min(DECODE_MAX_BUCKETS, len(rows) // DECODE_BUCKET_MIN))
    bs = meta.block_size
    for part in np.array_split(rows, buckets):
        d_ctx = ctx[part]
        nb = int(-(-d_ctx.max() // bs))
        mask = np.where(np.arange(nb * bs)[None, :] < d_ctx[:, None], 0.0, -np.inf)
        token_idx = cu_q[part]
        meta.decode.append(
            DecodePlan(
                token_idx=torch.from_numpy(token_idx).to(device),
                blocks=torch.from_numpy(np.ascontiguousarray(bt_np[part, :nb]).ravel()).to(device),
                num_seqs=len(part),
                blocks_per_seq=nb,
                mask=torch.from_numpy(mask).to(device=device, dtype=dtype)[:, None, None, :],
                identity=len(part) == len(cu_q) - 1
                and bool((token_idx == np.arange(len(part))).all()),
            )
        )


def _plan_prefill(
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
    for i in np.nonzero(q > 1)[0]:
        n, start, c = int(q[i]), int(starts[i]), int(ctx[i])
        blocks = mask = None
        if start > 0:  # attend to the cached prefix too: bottom-right aligned causal mask
            cols = torch.arange(c, device=device)
            rows = torch.arange(start, c, device=device)
            mask = torch.zeros((n, c), device=device, dtype=dtype)
            mask.masked_fill_(cols[None, :] > rows[:, None], float("-inf"))
            blocks = torch.from_numpy(bt_np[i, : -(-c // bs)].copy()).to(device)
        meta.prefills.append(PrefillPlan(int(cu_q[i]), int(cu_q[i + 1]), start, blocks, mask))


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
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if len(meta.decode) == 1 and meta.decode[0].identity:
        return _decode(q, k_cache, v_cache, meta.decode[0], meta, scale)
    out = q.new_empty(q.shape)
    if meta.decode_kernel is not None and meta.kernel_batch is not None:
        meta.decode_kernel(q, out, k_cache, v_cache, meta.kernel_batch, scale)
    for plan in meta.decode:
        qd = q.index_select(0, plan.token_idx)
        out.index_copy_(0, plan.token_idx, _decode(qd, k_cache, v_cache, plan, meta, scale))
    for p in meta.prefills:
        if p.blocks is None:  # no cached prefix: this chunk's own K/V is the whole context
            kp, vp = k[p.start : p.end], v[p.start : p.end]
        else:
            assert p.mask is not None
            ctx = p.mask.shape[1]
            kp = k_cache.index_select(0, p.blocks).view(-1, num_kv_heads, head_dim)[:ctx]
            vp = v_cache.index_select(0, p.blocks).view(-1, num_kv_heads, head_dim)[:ctx]
        o = F.scaled_dot_product_attention(
            q[p.start : p.end].transpose(0, 1)[None],  # [1, H, n, D]
            kp.transpose(0, 1)[None],  # [1, Hkv, ctx, D]
            vp.transpose(0, 1)[None],
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[p.start : p.end] = o[0].transpose(0, 1)
    return out


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One SDPA call for a bucket of single-token rows: ``q`` ``[Bd, H, D]`` -> ``[Bd, H, D]``."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    groups = num_heads // num_kv_heads
    shape = (plan.blocks.shape[0], block_size, num_kv_heads, head_dim)
    numel = shape[0] * block_size * num_kv_heads * head_dim
    flat = meta.scratch.take(2 * numel, k_cache.dtype, k_cache.device)
    k_buf, v_buf = flat[:numel].view(shape), flat[numel:].view(shape)
    torch.index_select(k_cache, 0, plan.blocks, out=k_buf)
    torch.index_select(v_cache, 0, plan.blocks, out=v_buf)
    length = plan.blocks_per_seq * block_size
    kd = k_buf.view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)  # [Bd, Hkv, L, D]
    vd = v_buf.view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)
    qd = q.view(num_seqs, num_kv_heads, groups, head_dim)  # G query heads per KV head as rows
    o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.mask, scale=scale)
    return o.reshape(num_seqs, num_heads, head_dim)
