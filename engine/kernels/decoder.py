"""A whole decoder step in one C call, for models whose projections are quantized.

``csrc/decoder.c`` runs every layer of a Llama-family decoder (norms, the quantized
projections of ``csrc/quant_matmul.c``, rotary, the KV-cache write, the paged attention
of ``csrc/paged_attention.c``, SwiGLU, residuals) for a flattened batch of tokens, so a
step costs one ``ctypes`` call instead of ~15 PyTorch ops per layer. At one sequence the
per-op overhead was as large as the matrix products (docs/benchmarks.md, "Engine profile").

:class:`FusedDecoder` is bound once to the weights (:class:`LayerWeights` per layer, all
of them CPU fp32 tensors or :class:`~engine.kernels.quant.QuantWeight`, kept referenced
here so their memory outlives every call) and to the KV pool (fp16 or fp32: K and V are
rounded to it as they are written, attention reads them back into fp32), then
:meth:`FusedDecoder.forward` runs a step. The C side checks nothing: every shape and
index is checked here, in the model runner (ids, block ids, lengths) and in
:func:`engine.attention.metadata.build_metadata`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenrelay.core.runtime import env_switch
from tokenrelay.engine.kernels.build import BUILD_ERRORS, CSRC, ENV_SWITCH, load
from tokenrelay.engine.kernels.quant import (
    KBLOCK,
    Q4_KX_ID,
    QuantStack,
    QuantWeight,
    quant_kernel,
)

log = logging.getLogger("tokenrelay.engine")

SOURCE = CSRC / "decoder.c"
FUSED_SWITCH = "TOKENRELAY_FUSED_DECODER"  # 0: the PyTorch decoder, kernel by kernel
# 0: Q4_K products on the file's own blocks, not repacked 16 rows at a time (kquant_x16.c)
REPACK_SWITCH = "TOKENRELAY_KQ_REPACK"
# Fewer rows than this many per thread: split each row's KV heads over attention tasks too
# (as engine/kernels/cpu_attention.py).
ROWS_PER_THREAD_FOR_WHOLE_HEADS = 4
KV_DTYPES = (torch.float16, torch.float32)  # what bind_cache() takes

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class _QPart(ctypes.Structure):
    _fields_ = [("w", _p), ("n", _i64), ("qtype", _i64)]


class _QMat(ctypes.Structure):
    _fields_ = [("part", _QPart * QuantStack.MAX_PARTS), ("parts", _i64), ("n", _i64),
                ("k", _i64)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _p),
        ("qkv", _QMat),
        ("qkv_bias", _p),
        ("q_norm", _p),
        ("k_norm", _p),
        ("o", _QMat),
        ("o_bias", _p),
        ("post_norm", _p),
        ("gate_up", _QMat),
        ("gate_up_bias", _p),
        ("down", _QMat),
        ("down_bias", _p),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i64),
        ("hidden", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("inter", _i64),
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        ("layers", ctypes.POINTER(_Layer)),
        ("final_norm", _p),
        ("kv", _p),
        ("num_blocks", _i64),
        ("block_size", _i64),
        ("head", _QMat),
        ("kv_f16", _i64),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("T", _i64),
        ("cos", _p),
        ("sin", _p),
        ("slots", _p),
        ("tables", _p),
        ("bt_stride", _i64),
        ("seqs", _p),
        ("rows", _p),
        ("lens", _p),
        ("heads_per_task", _i64),
        ("logits", _p),
    ]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights as the fused step reads them (biases/q-k norms optional)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Projection  # [(H + 2 Hkv) D, hidden]
    o: Projection  # [hidden, H D]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Projection  # [2 I, hidden]
    down: Projection  # [hidden, I]
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [D], with k_norm
    k_norm: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@dataclass(frozen=True)
class Shape:
    """The decoder's dimensions."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float  # attention's softmax scale


def _vector(t: torch.Tensor | None, n: int, what: str) -> torch.Tensor | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or t.device.type != "cpu" or tuple(t.shape) != (n,):
        raise ValueError(f"fused decoder: {what} must be fp32 [{n}] on the CPU")
    return t.contiguous()


# What the step multiplies: one quantized matrix, or one stacked from parts by rows.
Projection = QuantWeight | QuantStack


def _qmat(
    w: Projection, n: int, k: int, what: str, repack: Callable[[QuantWeight], Any] | None = None
) -> _QMat:
    """The C view of ``w``; ``repack`` may give a part another form (``(blocks, type id)``)."""
    if not isinstance(w, QuantWeight | QuantStack) or w.shape != (n, k):
        raise ValueError(f"fused decoder: {what} must be a QuantWeight or QuantStack [{n}, {k}]")
    parts = w.parts if isinstance(w, QuantStack) else (w,)
    mat = _QMat(parts=len(parts), n=n, k=k)
    for i, part in enumerate(parts):
        other = repack(part) if repack is not None else None
        if other is not None:
            mat.part[i] = _QPart(other[0].data_ptr(), part.n, other[1])
        else:
            mat.part[i] = _QPart(part.data_ptr, part.n, part.type_id)
    return mat


class _Repacker:
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
        _page_out(w.blocks)
        return out, Q4_KX_ID


def _page_out(t: torch.Tensor) -> None:
    """Ask the OS to reclaim the whole pages of ``t`` (a hint: the data stays valid)."""
    advice = getattr(mmap, "MADV_PAGEOUT", None)
    if advice is None:
        return
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(advice))


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class FusedDecoder:
    """Every layer of one model in one C call per step (fp32 activations, CPU)."""

    def __init__(self, library: ctypes.CDLL, shape: Shape, layers: list[LayerWeights],
                 final_norm: torch.Tensor, head: QuantWeight | None = None) -> None:  # fmt: skip
        fn = library.tr_decoder_forward
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step), _p]
        self._fn = fn
        self.shape = s = shape
        if s.head_dim % 2 or s.num_heads % s.num_kv_heads:
            raise ValueError("fused decoder: head_dim must be even, heads a multiple of KV heads")
        qkv_n = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        keep: list[object] = []  # every tensor whose memory the C side reads

        def ptr(t: torch.Tensor | None, n: int, what: str) -> int | None:
            v = _vector(t, n, what)
            if v is None:
                return None
            keep.append(v)
            return v.data_ptr()

        repack = _Repacker()
        structs = []
        for i, lw in enumerate(layers):
            if (lw.q_norm is None) != (lw.k_norm is None):
                raise ValueError(f"fused decoder: layer {i} has only one of q_norm and k_norm")
            keep.extend((lw.qkv, lw.o, lw.gate_up, lw.down))
            structs.append(_Layer(
                ptr(lw.input_norm, s.hidden, "input_norm"),
                _qmat(lw.qkv, qkv_n, s.hidden, "qkv", repack),
                ptr(lw.qkv_bias, qkv_n, "qkv_bias"),
                ptr(lw.q_norm, s.head_dim, "q_norm"),
                ptr(lw.k_norm, s.head_dim, "k_norm"),
                _qmat(lw.o, s.hidden, s.num_heads * s.head_dim, "o", repack),
                ptr(lw.o_bias, s.hidden, "o_bias"),
                ptr(lw.post_norm, s.hidden, "post_norm"),
                _qmat(lw.gate_up, 2 * s.intermediate, s.hidden, "gate_up", repack),
                ptr(lw.gate_up_bias, 2 * s.intermediate, "gate_up_bias"),
                _qmat(lw.down, s.hidden, s.intermediate, "down", repack),
                ptr(lw.down_bias, s.hidden, "down_bias"),
            ))  # fmt: skip
        self._layers = (_Layer * len(structs))(*structs)
        self._model = _Model(
            len(structs), s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate,
            s.eps, s.scale, self._layers, ptr(final_norm, s.hidden, "final_norm"),
        )  # fmt: skip
        # the LM head, if quantized: a step can end with every row's logits
        self.vocab = head.n if isinstance(head, QuantWeight) else None
        if isinstance(head, QuantWeight):
            self._model.head = _qmat(head, head.n, s.hidden, "head", repack)
            keep.append(head)
        keep.extend(repack.copies)
        if repack.copies:
            gib = sum(c.numel() for c in repack.copies) / 2**30
            log.info("Q4_K projections repacked for the AVX-512 kernel",
                     extra={"gib": round(gib, 3), "seconds": round(repack.seconds, 2)})  # fmt: skip
        self._keep = keep
        self.kv: torch.Tensor | None = None  # the pool bound by bind_cache()

    def bind_cache(self, kv: torch.Tensor) -> None:
        """Use ``kv`` ``[layers, 2, num_blocks, block_size, Hkv, D]`` (contiguous, fp16 or
        fp32: the step writes K and V rounded to it, and attends in fp32 either way)."""
        s = self.shape
        if kv.dtype not in KV_DTYPES:
            raise ValueError(
                f"fused decoder: the KV pool must be float16 or float32, not {kv.dtype}"
            )
        if (
            kv.device.type != "cpu"
            or not kv.is_contiguous()
            or kv.dim() != 6
            or kv.shape[0] != self._model.num_layers
            or kv.shape[1] != 2
            or tuple(kv.shape[4:]) != (s.num_kv_heads, s.head_dim)
        ):
            raise ValueError(f"fused decoder: the KV pool has shape {tuple(kv.shape)}")
        self.kv = kv
        self._model.kv = kv.data_ptr()
        self._model.kv_f16 = int(kv.dtype == torch.float16)
        self._model.num_blocks, self._model.block_size = kv.shape[2], kv.shape[3]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        seqs: torch.Tensor,
        lens: torch.Tensor,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run every layer and the final norm on ``x`` ``[T, hidden]`` in place; returns it.

        ``cos``/``sin`` ``[T, D/2]`` fp32; ``slots`` ``[T]`` int64 KV slot of each token;
        ``tables`` ``[B, max_blocks]`` int32; ``seqs`` ``[T]`` int64 each token's row of
        ``tables``; ``lens`` ``[T]`` int32 tokens each one attends to (position + 1).
        ``logits``: a contiguous fp32 ``[T, vocab]`` the step fills with every row's
        logits through the LM head (only when built with one: :attr:`vocab`).
        """
        kv = self.kv
        if kv is None:
            raise RuntimeError("fused decoder: bind_cache() was not called")
        t = x.shape[0]
        half = self.shape.head_dim // 2
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape != (t, self.shape.hidden):
            raise ValueError("fused decoder: x must be contiguous fp32 [T, hidden]")
        cos, sin = cos.reshape(t, half).contiguous(), sin.reshape(t, half).contiguous()
        slots, seqs = slots.contiguous(), seqs.contiguous()
        tables, lens = tables.contiguous(), lens.contiguous()
        rows = torch.arange(t, dtype=torch.int64)
        if t:
            num_slots = kv.shape[2] * kv.shape[3]
            checks: tuple[tuple[bool, str], ...] = (
                (cos.dtype == sin.dtype == torch.float32, "cos/sin must be fp32"),
                (slots.shape == (t,) and slots.dtype == torch.int64, "slots must be int64 [T]"),
                (seqs.shape == (t,) and seqs.dtype == torch.int64, "seqs must be int64 [T]"),
                (lens.shape == (t,) and lens.dtype == torch.int32, "lens must be int32 [T]"),
                (tables.dim() == 2 and tables.dtype == torch.int32, "tables must be int32 2-D"),
            )
            for ok, why in checks:
                if not ok:
                    raise ValueError(f"fused decoder: {why}")
            bounds = (
                (slots, 0, num_slots - 1, "a slot outside the pool"),
                (seqs, 0, tables.shape[0] - 1, "a bad seq"),
                (lens, 1, tables.shape[1] * kv.shape[3], "a length beyond its block table"),
                (tables, 0, kv.shape[2] - 1, "a block outside the pool"),
            )
            for values, least, most, why in bounds:
                lo, hi = values.aminmax()  # one pass each
                if int(lo) < least or int(hi) > most:
                    raise ValueError(f"fused decoder: {why}")
        if logits is not None and (
            self.vocab is None
            or logits.dtype != torch.float32
            or not logits.is_contiguous()
            or logits.shape != (t, self.vocab)
        ):
            raise ValueError(f"fused decoder: logits must be contiguous fp32 [T, {self.vocab}]")
        whole = t >= ROWS_PER_THREAD_FOR_WHOLE_HEADS * torch.get_num_threads()
        step = _Step(
            t, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
            tables.shape[1], seqs.data_ptr(), rows.data_ptr(), lens.data_ptr(),
            self.shape.num_kv_heads if whole else 1,
            None if logits is None else logits.data_ptr(),
        )  # fmt: skip
        if t:
            rc = self._fn(ctypes.byref(self._model), ctypes.byref(step), x.data_ptr())
            if rc == -2:
                raise MemoryError("fused decoder: out of memory for its scratch buffers")
            if rc != 0:
                raise RuntimeError(f"fused decoder: the C step failed ({rc})")
        return x


@functools.cache
def decoder_library() -> ctypes.CDLL | None:
    """The compiled fused decoder, built on first call; ``None`` where off or not buildable."""
    if not (env_switch(ENV_SWITCH) and env_switch(FUSED_SWITCH)):
        log.info("fused decoder off", extra={"switches": f"{ENV_SWITCH}, {FUSED_SWITCH}"})
        return None
    try:
        return load(SOURCE)
    except BUILD_ERRORS as exc:
        log.warning(
            "fused decoder unavailable, running the decoder op by op",
            extra={"error": str(exc)[-500:]},
        )
        return None
