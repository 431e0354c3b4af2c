"""Compiled CPU kernels: built from ``engine/kernels/csrc`` with the system C compiler, cached.

PyTorch has no paged attention for CPUs: the torch path copies every decoding
sequence's K and V out of the block pool (``index_select``) before SDPA reads the copy,
which makes the gather as costly as the attention itself. ``csrc/paged_attention.c``
reads the blocks where they are (docs/benchmarks.md, "Engine profile").

The kernel is plain C with OpenMP, called through ``ctypes``; it needs no PyTorch
headers and compiles quickly. It is built on first use with
``$CC`` (else ``cc``) and ``-march=native`` into ``$TOKENRELAY_HOME/kernels``, under a
name that hashes the source, the flags, the compiler's version and this CPU's feature
flags, so a cache shared between machines never loads code built for another CPU
(:mod:`tokenrelay.engine.kernels.build`, shared with the other compiled kernels).
Where no compiler works the engine logs why and keeps the torch path;
``TOKENRELAY_CPU_KERNELS=0`` chooses the torch path outright.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenrelay.core.runtime import env_switch
from tokenrelay.engine.kernels.build import BUILD_ERRORS, CSRC, ENV_SWITCH, build

log = logging.getLogger("tokenrelay.engine")

__all__ = ["ENV_SWITCH", "SOURCE", "DecodeBatch", "PagedDecode", "build", "paged_decode"]

SOURCE = CSRC / "paged_attention.c"
# Fewer sequences than this many per thread: split each one's KV heads over tasks too.
SEQS_PER_THREAD_FOR_WHOLE_HEADS = 4

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


@dataclass(frozen=True)
class DecodeBatch:
    """One step's decode rows for :class:`PagedDecode`, checked once (contiguous copies).

    It holds the tensors whose memory the C side reads, so none is freed before a call.
    """

    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32
    rows: torch.Tensor  # [n] int64 q/out row of each decode row
    seqs: torch.Tensor  # [n] int64 its sequence (row of block_tables)
    block_size: int
    max_block: int  # largest block id in the tables (-1: no rows)
    max_row: int  # largest q/out row (-1: no rows)


# what the pool may hold: the kernel reads either, its arithmetic is fp32
CACHE_DTYPES = (torch.float32, torch.float16)


class PagedDecode:
    """Decode attention over the paged KV pool, one query token per sequence (fp32 q and
    out, the pool fp32 or fp16; CPU)."""

    def __init__(self, library: Path) -> None:
        self.path = library
        fn = ctypes.CDLL(str(library)).tr_paged_decode
        fn.restype = ctypes.c_int
        fn.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr]
        fn.argtypes += [_i64] * 6 + [_f32, _i64, _i64, _f32]
        self._fn = fn

    @staticmethod
    def plan(
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        rows: torch.Tensor,
        seqs: torch.Tensor,
        block_size: int,
    ) -> DecodeBatch:
        """Check one step's decode rows once, for every layer's call.

        ``block_tables`` ``[B, max_blocks]`` int32, ``context_lens`` ``[B]`` int32,
        ``rows`` / ``seqs`` ``[n]`` int64: the q/out row and the sequence of each decode
        row. The C side checks no bounds, so every index it follows is checked here (the
        pool's size and q's rows at each call).
        """
        if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
            raise ValueError("paged decode kernel: block tables and lengths must be int32")
        if rows.dtype != torch.int64 or seqs.dtype != torch.int64:
            raise ValueError("paged decode kernel: rows and seqs must be int64")
        tables, lens = block_tables.contiguous(), context_lens.contiguous()
        rows, seqs = rows.contiguous(), seqs.contiguous()
        max_block = max_row = -1
        if rows.numel():
            lo, max_block = (int(x) for x in tables.aminmax())
            if lo < 0:
                raise ValueError("paged decode kernel: a block id outside the pool")
            lo, hi = (int(x) for x in lens.aminmax())
            if not 1 <= lo <= hi <= tables.shape[1] * block_size:
                raise ValueError("paged decode kernel: a context length outside its block table")
            lo, hi = (int(x) for x in seqs.aminmax())
            if lo < 0 or hi >= min(tables.shape[0], lens.shape[0]):
                raise ValueError("paged decode kernel: a sequence outside the block tables")
            lo, max_row = (int(x) for x in rows.aminmax())
            if lo < 0:
                raise ValueError("paged decode kernel: a row outside q or out")
        return DecodeBatch(tables, lens, rows, seqs, block_size, max_block, max_row)

    def __call__(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """Write ``out[rows]`` ``[n, H, D]`` = attention of ``q[rows]`` over each sequence.

        ``q`` ``[T, H, D]`` (rows may be strided; heads and dims contiguous), ``out``
        ``[T, H, D]`` contiguous, both fp32; caches ``[num_blocks, block_size, Hkv, D]``,
        both fp32 or both fp16; ``batch`` from :meth:`plan`. ``window``: each row sees
        only its last ``window`` keys; ``softcap``: scores become ``softcap * tanh(s /
        softcap)`` (both as :meth:`AttentionBackend.forward` takes them).
        """
        if (window is not None and window < 1) or (softcap is not None and not softcap > 0):
            raise ValueError("paged decode kernel: window and softcap must be positive")
        _, num_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads, _ = k_cache.shape
        tensors = (q, out, k_cache, v_cache)
        if any(t.device.type != "cpu" for t in tensors) or not (
            q.dtype == out.dtype == torch.float32
            and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in CACHE_DTYPES
        ):
            raise ValueError(
                "paged decode kernel: q and out must be fp32 and the caches both fp32 or both "
                "fp16, on a CPU"
            )
        if k_cache.shape != v_cache.shape:
            raise ValueError("paged decode kernel: the K and V caches differ in shape")
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            raise ValueError("paged decode kernel: q's heads and dims must be contiguous")
        if not (out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("paged decode kernel: out and the caches must be contiguous")
        if num_heads % num_kv_heads:
            raise ValueError("paged decode kernel: query heads must be a multiple of KV heads")
        if block_size != batch.block_size:
            raise ValueError("paged decode kernel: the batch was planned for another block size")
        if batch.max_block >= num_blocks:
            raise ValueError(f"paged decode kernel: a block id outside the pool of {num_blocks}")
        if batch.max_row >= min(q.shape[0], out.shape[0]):
            raise ValueError("paged decode kernel: a row outside q or out")
        n = int(batch.rows.shape[0])
        whole = n >= SEQS_PER_THREAD_FOR_WHOLE_HEADS * torch.get_num_threads()
        rc = self._fn(
            q.data_ptr(),
            q.stride(0),
            out.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            batch.block_tables.data_ptr(),
            batch.block_tables.shape[1],
            batch.context_lens.data_ptr(),
            batch.rows.data_ptr(),
            batch.seqs.data_ptr(),
            None,  # each row attends to its sequence's whole context
            n,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            num_kv_heads if whole else 1,
            scale,
            int(k_cache.dtype == torch.float16),
            window or 0,
            softcap or 0.0,
        )
        if rc != 0:
            raise MemoryError("paged decode kernel: out of memory for its score buffers")


@functools.cache
def paged_decode() -> PagedDecode | None:
    """The decode kernel, built on first call; ``None`` where disabled or not buildable."""
    if not env_switch(ENV_SWITCH):
        log.info("CPU kernels off", extra={"switch": ENV_SWITCH})
        return None
    try:
        return PagedDecode(build(SOURCE))
    except BUILD_ERRORS as exc:
        log.warning(
            "CPU kernel unavailable, using the torch attention path",
            extra={"error": str(exc)[-500:]},
        )
        return None
