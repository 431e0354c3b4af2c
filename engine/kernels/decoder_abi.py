"""The C side of the fused decoder step (``csrc/decoder.c``) as ctypes sees it.

The structures mirror ``tr_model``, ``tr_layer``, ``tr_qmat`` and ``tr_step`` field by
field (a field added in C is added here, in the same place). :func:`qmat` hands a
quantized projection to C as the parts of a matrix stacked by rows, each read where the
file maps it, or repacked where a faster kernel has its own layout (:class:`Repacker`).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import time
from collections.abc import Callable
from typing import Any

import torch

from tokenrelay.core.runtime import env_switch
from tokenrelay.engine.kernels.quant import (
    KBLOCK,
    Q4_KX_ID,
    QuantStack,
    QuantWeight,
    quant_kernel,
)

# 0: Q4_K products on the file's own blocks, not repacked 16 rows at a time (kquant_x16.c)
REPACK_SWITCH = "TOKENRELAY_KQ_REPACK"

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class QPart(ctypes.Structure):
    """One part of a stacked matrix: ``tr_qpart``."""

    _fields_ = [("w", _p), ("n", _i64), ("qtype", _i64)]


class QMat(ctypes.Structure):
    """A matrix stacked by rows from its parts: ``tr_qmat``."""

    _fields_ = [("part", QPart * QuantStack.MAX_PARTS), ("parts", _i64), ("n", _i64),
                ("k", _i64)]  # fmt: skip


class CLayer(ctypes.Structure):
    """One layer's weights and settings: ``tr_layer``."""

    _fields_ = [
        ("input_norm", _p),
        ("qkv", QMat),
        ("qkv_bias", _p),
        ("q_norm", _p),
        ("k_norm", _p),
        ("o", QMat),
        ("o_bias", _p),
        ("attn_out_norm", _p),
        ("post_norm", _p),
        ("gate_up", QMat),
        ("gate_up_bias", _p),
        ("down", QMat),
        ("down_bias", _p),
        ("mlp_out_norm", _p),
        ("window", _i64),
        ("local_rope", _i64),
    ]


class CModel(ctypes.Structure):
    """The whole model, its KV pool and scalars: ``tr_model``."""

    _fields_ = [
        ("num_layers", _i64),
        ("hidden", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("inter", _i64),
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        ("layers", ctypes.POINTER(CLayer)),
        ("final_norm", _p),
        ("kv", _p),
        ("num_blocks", _i64),
        ("block_size", _i64),
        ("head", QMat),
        ("kv_f16", _i64),
        ("rot_dim", _i64),
        ("qk_norm_whole", _i64),
        ("act", _i64),
        ("residual_scale", ctypes.c_double),
        ("softcap", ctypes.c_double),
    ]


class CStep(ctypes.Structure):
    """One step's inputs: ``tr_step``."""

    _fields_ = [
        ("T", _i64),
        ("cos", _p),
        ("sin", _p),
        ("cos_local", _p),
        ("sin_local", _p),
        ("slots", _p),
        ("tables", _p),
        ("bt_stride", _i64),
        ("seqs", _p),
        ("rows", _p),
        ("lens", _p),
        ("heads_per_task", _i64),
        ("logits", _p),
    ]


def vector(t: torch.Tensor | None, n: int, what: str) -> torch.Tensor | None:
    """``t`` checked as a contiguous fp32 CPU vector of ``n`` values (``None`` passes)."""
    if t is None:
        return None
    if t.dtype != torch.float32 or t.device.type != "cpu" or tuple(t.shape) != (n,):
        raise ValueError(f"fused decoder: {what} must be fp32 [{n}] on the CPU")
    return t.contiguous()


# What the step multiplies: one quantized matrix, or one stacked from parts by rows.
Projection = QuantWeight | QuantStack


def qmat(
    w: Projection, n: int, k: int, what: str, repack: Callable[[QuantWeight], Any] | None = None
) -> QMat:
    """The C view of ``w``; ``repack`` may give a part another form (``(blocks, type id)``)."""
    if not isinstance(w, QuantWeight | QuantStack) or w.shape != (n, k):
        raise ValueError(f"fused decoder: {what} must be a QuantWeight or QuantStack [{n}, {k}]")
    parts = w.parts if isinstance(w, QuantStack) else (w,)
    mat = QMat(parts=len(parts), n=n, k=k)
    for i, part in enumerate(parts):
        other = repack(part) if repack is not None else None
        if other is not None:
            mat.part[i] = QPart(other[0].data_ptr(), part.n, other[1])
        else:
            mat.part[i] = QPart(part.data_ptr, part.n, part.type_id)
    return mat


class Repacker:
    """Q4_K projections repacked 16 rows at a time for the AVX512-VNNI kernel, where the
    build has it: a copy in the kernel's order; the file's pages of the original are
    handed back to the OS (they are read again only if something else multiplies them)."""

    def __init__(self) -> None:
        self.kernel = quant_kernel() if env_switch(REPACK_SWITCH) else None
        self.copies: list[torch.Tensor] = []
        self.seconds = 0.0

    def __call__(self, w: QuantWeight) -> tuple[torch.Tensor, int] | None:
        if self.kernel is None or w.qtype != "Q4_K" or w.n % 16 or w.k % KBLOCK:
            return None
        started = time.perf_counter()
        out = self.kernel.interleave(w)
        self.seconds += time.perf_counter() - started
        if out is None:  # no such form in this build (no AVX512-VNNI)
            self.kernel = None
            return None
        self.copies.append(out)
        page_out(w.blocks)
        return out, Q4_KX_ID


def page_out(t: torch.Tensor) -> None:
    """Ask the OS to reclaim the whole pages of ``t`` (a hint: the data stays valid)."""
    advice = getattr(mmap, "MADV_PAGEOUT", None)
    if advice is None:
        return
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end > start:
        libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(advice))


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library the process already has (for madvise)."""
    return ctypes.CDLL(None, use_errno=True)
