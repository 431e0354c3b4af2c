"""Paged attention in Triton: decode and varlen prefill, reading K/V from the blocks in place.

The KV pool of one layer is ``k_cache``/``v_cache`` ``[num_blocks, block_size, Hkv, D]``;
the token at position ``p`` of sequence ``b`` lives in block ``block_tables[b, p //
block_size]`` at offset ``p % block_size``. The step's own K/V are already in the pool.

* :func:`paged_decode`: one query token per sequence. A program owns one (sequence, KV
  head) and all ``G = H // Hkv`` query heads of that KV head (rows of one ``tl.dot``,
  padded to 16), so each K/V tile is loaded once per KV head. The context is split into
  ``num_splits`` partitions (flash-decoding) whose sizes the kernel derives from
  ``context_lens[b]``; a second kernel merges them by their log-sum-exp. The grid
  depends only on ``B``, ``Hkv`` and the split count (which depends only on ``B``,
  ``Hkv`` and the GPU), never on the step's lengths: CUDA graphs can replay it.
* :func:`paged_prefill`: a varlen batch of query chunks, each with a possibly cached
  prefix (decode rows are chunks of one). A program owns ``TOK`` query tokens of one
  sequence times the ``G`` heads of one KV head (64 rows), and walks the keys causally.

Softmax runs in fp32 (base 2, the scale folded in); fp32 inputs use IEEE dots (no
TF32). A layer's sliding window (``window``: a query at position ``p`` sees keys ``p -
window + 1 .. p``) moves where each program starts reading keys and masks the rest of
the tile; soft-capping (``softcap``, Gemma 2) bends each score through ``tanh`` before
the softmax. Any head dim up to 256 works: it is padded to a power of two (at least 16) with
masks, as are the query rows of a ``tl.dot`` (>= 16 on GPUs). Keys are addressed per
token through the block table, so any block size works. Without Triton the module
still imports; :func:`available` then returns False.
"""

import os
from types import SimpleNamespace
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - CPU machines without triton keep the other backends
    HAVE_TRITON = False
    triton = SimpleNamespace(jit=lambda fn: fn)  # type: ignore[no-redef]
    tl = SimpleNamespace(constexpr=int, tensor=object)  # type: ignore[no-redef]

__all__ = ["MAX_SPLITS", "available", "paged_decode", "paged_prefill"]

MAX_SPLITS = 16  # most decode partitions per (sequence, KV head)
PREFILL_ROWS = 64  # (query token, head) rows per prefill program
LOG2E = 1.4426950408889634
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def available() -> bool:
    """Triton imports, and kernels can run: on a CUDA device, or under the interpreter."""
    interpret = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    return HAVE_TRITON and (torch.cuda.is_available() or interpret)


@triton.jit
def _dot(a: tl.tensor, b: tl.tensor, PRECISION: tl.constexpr, UPCAST: tl.constexpr) -> tl.tensor:
    """``a @ b`` in fp32; ``UPCAST`` (bf16 under the interpreter, whose bf16 dot is wrong)."""
    if UPCAST:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b, input_precision=PRECISION)
    return r


@triton.jit
def _attend(
    q: tl.tensor, qpos: tl.tensor, k_base: tl.tensor, v_base: tl.tensor, bt_row: tl.tensor,
    stride_btw: int, stride_kb: int, stride_ks: int, lo: tl.tensor, hi: tl.tensor,
    qk_scale: float, window: int, offs_d: tl.tensor, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
) -> tl.tensor:  # fmt: skip
    """Online softmax of the ``q`` rows over keys ``lo..hi`` (< context length), with key
    ``n`` masked beyond ``qpos`` or ``window`` before it if ``CAUSAL``; ``SOFTCAP`` > 0:
    scores ``SOFTCAP * tanh(s)`` (``qk_scale`` is then ``scale / SOFTCAP``, not base 2);
    -> (normalized out, row max, row sum)."""
    acc = tl.zeros(q.shape, dtype=tl.float32)
    m_i = tl.full([q.shape[0]], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([q.shape[0]], dtype=tl.float32)
    d_ok = offs_d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        blk = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_btw, mask=n_ok, other=0)
        slot = blk.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks
        k_mask = d_ok[:, None] & n_ok[None, :]
        k = tl.load(k_base + slot[None, :] + offs_d[:, None], mask=k_mask, other=0.0)
        s = _dot(q, k, PRECISION, UPCAST) * qk_scale
        if SOFTCAP > 0:  # tanh(s) = 1 - 2 / (e^2s + 1) (2.885 = 2 log2(e)), then base 2
            tanh = 1.0 - 2.0 / (tl.exp2(s * 2.8853900817779268) + 1.0)
            s = tanh * (SOFTCAP * 1.4426950408889634)
        keep = n_ok[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= qpos[:, None])
            keep = keep & (offs_n[None, :] > qpos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        v_mask = n_ok[:, None] & d_ok[None, :]
        v = tl.load(v_base + slot[:, None] + offs_d[None, :], mask=v_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None], m_i, l_i  # no keys: zeros


@triton.jit
def _decode_kernel(
    q_ptr: tl.tensor, k_ptr: tl.tensor, v_ptr: tl.tensor, bt_ptr: tl.tensor,
    lens_ptr: tl.tensor, out_ptr: tl.tensor, part_ptr: tl.tensor, lse_ptr: tl.tensor,
    qk_scale: float, window: int, stride_qb: int, stride_qh: int, stride_ob: int, stride_oh: int,
    stride_btb: int, stride_btw: int, stride_kb: int, stride_ks: int, stride_kh: int,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
) -> None:  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    first = tl.maximum(ctx - window, 0)  # the window's first key
    per_split = tl.cdiv(tl.cdiv(ctx - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, ctx)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = (offs_g < G)[:, None] & (offs_d < HEAD_DIM)[None, :]
    heads = kvh * G + offs_g
    q_off = b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_mask, other=0.0)
    kv_off = kvh * stride_kh
    o, m_i, l_i = _attend(
        q, offs_g, k_ptr + kv_off, v_ptr + kv_off,
        bt_ptr + b.to(tl.int64) * stride_btb, stride_btw, stride_kb, stride_ks,
        lo, hi, qk_scale, window, offs_d, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, SOFTCAP,
        PRECISION, UPCAST,
    )  # fmt: skip
    if NUM_SPLITS == 1:
        o_off = b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        row = (b.to(tl.int64) * G * tl.num_programs(1) + heads) * NUM_SPLITS + split
        tl.store(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=offs_g < G)


@triton.jit
def _reduce_kernel(
    part_ptr: tl.tensor, lse_ptr: tl.tensor, out_ptr: tl.tensor, stride_ob: int, stride_oh: int,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
) -> None:  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = (b.to(tl.int64) * tl.num_programs(1) + h) * NUM_SPLITS
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    lse = tl.load(lse_ptr + row + offs_s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    mask = s_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    parts = tl.load(part_ptr + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask)
    total = tl.sum(w, 0)
    o = tl.sum(tl.where(mask, parts, 0.0) * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    o_ptr = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
    tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    q_ptr: tl.tensor, k_ptr: tl.tensor, v_ptr: tl.tensor, bt_ptr: tl.tensor, cu_ptr: tl.tensor,
    lens_ptr: tl.tensor, out_ptr: tl.tensor, qk_scale: float, window: int, stride_qt: int,
    stride_qh: int,
    stride_ot: int, stride_oh: int, stride_btb: int, stride_btw: int, stride_kb: int,
    stride_ks: int, stride_kh: int, G: tl.constexpr, G_PAD: tl.constexpr, TOK: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
) -> None:  # fmt: skip
    m0 = tl.program_id(0) * TOK
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    if m0 >= q_len:
        return
    ctx = tl.load(lens_ptr + b)
    offs_r = tl.arange(0, TOK * G_PAD)
    tok = m0 + offs_r // G_PAD
    g = offs_r % G_PAD
    offs_d = tl.arange(0, BLOCK_D)
    rows_ok = (tok < q_len) & (g < G)
    mask = rows_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    t = (q_start + tok).to(tl.int64)
    heads = kvh * G + g
    q_off = t[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=mask, other=0.0)
    qpos = ctx - q_len + tok
    hi = ctx - q_len + tl.minimum(m0 + TOK, q_len)  # one past the tile's last query
    lo = tl.maximum(ctx - q_len + m0 - window + 1, 0)  # the first query's window
    kv_off = kvh * stride_kh
    o, _, _ = _attend(
        q, qpos, k_ptr + kv_off, v_ptr + kv_off,
        bt_ptr + b.to(tl.int64) * stride_btb, stride_btw, stride_kb, stride_ks,
        lo, hi, qk_scale, window, offs_d, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, SOFTCAP,
        PRECISION, UPCAST,
    )  # fmt: skip
    o_off = t[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=mask)


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(n - 1, 0).bit_length())


def _default_splits(q: torch.Tensor, programs: int) -> int:
    """Partitions for about two programs per SM; 1 off-GPU or when ``B * Hkv`` fills the GPU."""
    if not q.is_cuda or programs == 0:
        return 1
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return 1 if programs >= sms else min(MAX_SPLITS, -(-2 * sms // programs))


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    n_seqs: int,
) -> tuple[int, int]:
    """Shape/dtype/device checks only (nothing reads device memory); returns (G, Hkv)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    if q.dim() != 3 or q.stride(-1) != 1 or not 0 < q.shape[2] <= 256:
        raise ValueError(f"q must be [T, H, D<=256] with a contiguous last dim, got {q.shape}")
    if q.dtype not in DTYPES:
        raise ValueError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[3] != q.shape[2] or not c.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous [num_blocks, block_size, Hkv, {q.shape[2]}] "
                f"tensor, got {tuple(c.shape)}"
            )
        if c.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {c.dtype}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {v_cache.shape} differs from k_cache {k_cache.shape}")
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q's {heads} heads are not a multiple of the cache's {kv_heads}")
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be like q ({q.shape}, {q.dtype}, contiguous last dim)")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be a 2-D int32 tensor, got {block_tables.dtype}")
    if block_tables.shape[0] != n_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {n_seqs} sequences")
    if context_lens.dtype != torch.int32 or context_lens.shape != (n_seqs,):
        raise ValueError(f"context_lens must be int32 [{n_seqs}], got {context_lens.dtype}")
    if not context_lens.is_contiguous():
        raise ValueError("context_lens must be contiguous")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out),
                    ("block_tables", block_tables), ("context_lens", context_lens)):  # fmt: skip
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    return heads // kv_heads, kv_heads


def _layer(scale: float, window: int | None, softcap: float | None) -> tuple[float, int, float]:
    """The kernels' ``qk_scale``, ``window`` (none: past any context) and ``SOFTCAP`` (0: none)."""
    if (window is not None and window < 1) or (softcap is not None and not softcap > 0):
        raise ValueError("window and softcap must be positive")
    qk_scale = scale / softcap if softcap else scale * LOG2E
    return qk_scale, window or 1 << 30, float(softcap or 0.0)


def _meta(q: torch.Tensor) -> dict[str, Any]:
    """Tile and dot settings by dtype. fp32 runs IEEE dots (no TF32), which spill registers
    (sm_90) with 64-key tiles: 16-key tiles and 8 warps. ``UPCAST``: bf16 off-GPU, where the
    interpreter's bf16 ``tl.dot`` is wrong."""
    fp32 = q.dtype == torch.float32
    return {
        "BLOCK_N": 16 if fp32 else 64,
        "PRECISION": "ieee" if fp32 else "tf32",  # tf32 only affects fp32 dots
        "UPCAST": q.dtype == torch.bfloat16 and not q.is_cuda,
        "num_warps": 8 if fp32 else 4,
    }


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    num_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence (``q``/``out`` ``[B, H, D]``) -> ``out``.

    Row ``b`` attends to its first ``context_lens[b]`` cached tokens (none: zeros), the
    last ``window`` of them only where a window is given; ``softcap`` caps the scores.
    Graph-safe: nothing here reads device values. ``num_splits`` overrides the number of
    context partitions (default: by ``B * Hkv`` against the GPU's SMs; 1 off-GPU).
    """
    batch = q.shape[0] if q.dim() == 3 else -1
    group, kv_heads = _check(q, k_cache, v_cache, block_tables, context_lens, out, batch)
    if num_splits is None:
        num_splits = _default_splits(q, batch * kv_heads)
    if not 1 <= num_splits <= 256:
        raise ValueError(f"num_splits must be in 1..256, got {num_splits}")
    if batch == 0:
        return out
    head_dim, block_d = q.shape[2], _pow2(q.shape[2], 16)
    part, lse = out, out  # placeholders, unused with a single split
    if num_splits > 1:  # per-split outputs and log2-sum-exps, merged by _reduce_kernel
        lse = q.new_empty((batch, q.shape[1], num_splits), dtype=torch.float32)
        part = q.new_empty((*lse.shape, head_dim), dtype=torch.float32)
    qk_scale, win, cap = _layer(scale, window, softcap)
    _decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part, lse, qk_scale, win,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        block_tables.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        G=group, HEAD_DIM=head_dim, BLOCK_G=_pow2(group, 16), BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1], NUM_SPLITS=num_splits, SOFTCAP=cap, **_meta(q),
    )  # fmt: skip
    if num_splits > 1:
        _reduce_kernel[(batch, q.shape[1])](
            part, lse, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d,
            NUM_SPLITS=num_splits, BLOCK_S=_pow2(num_splits), num_warps=4,
        )  # fmt: skip
    return out


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    out: torch.Tensor,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a varlen batch of query chunks (``q``/``out`` ``[T, H, D]``),
    within a sliding ``window`` and with soft-capped scores where they are given.

    Sequence ``b``'s rows are ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``; its last row sits
    at position ``context_lens[b] - 1`` and the chunk's earlier keys (a cached prefix
    included) are read from the cache. ``max_seqlen_q`` (a host int) sizes the grid.
    """
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 1:
        raise ValueError(
            f"cu_seqlens_q must be a 1-D int32 [B + 1] tensor, got {cu_seqlens_q.dtype}"
        )
    if not cu_seqlens_q.is_contiguous() or cu_seqlens_q.device != q.device:
        raise ValueError("cu_seqlens_q must be contiguous and on q's device")
    batch = cu_seqlens_q.numel() - 1
    group, kv_heads = _check(q, k_cache, v_cache, block_tables, context_lens, out, batch)
    if max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q must be >= 0, got {max_seqlen_q}")
    if batch == 0 or max_seqlen_q == 0 or q.shape[0] == 0:
        return out
    g_pad = _pow2(group)
    tok = max(1, PREFILL_ROWS // g_pad)
    grid = (-(-max_seqlen_q // tok), batch, kv_heads)
    qk_scale, win, cap = _layer(scale, window, softcap)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, qk_scale, win,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        block_tables.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        G=group, G_PAD=g_pad, TOK=tok, HEAD_DIM=q.shape[2], BLOCK_D=_pow2(q.shape[2], 16),
        BLOCK_SIZE=k_cache.shape[1], SOFTCAP=cap, **_meta(q),
    )  # fmt: skip
    return out
