"""GGUF-quantized weight matrices on the CPU, multiplied without dequantizing them in memory.

A :class:`QuantWeight` holds a weight matrix ``W`` ``[N, K]`` exactly as a GGUF file
stores it (a tensor's bytes, :meth:`engine.models.gguf_file.GGUFIndex.data`: a uint8
array ``[N, K / 32 * block bytes]``, N rows of ggml blocks of 32 weights) in one of
the formats in :data:`QTYPES` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or the K-quants of
:data:`KQTYPES`, super-blocks of 256 weights (Q4_K, Q5_K, Q6_K); :mod:`.quant_formats`
documents each layout. The K-quants are multiplied the way the format was designed
for: each row of ``x`` is quantized to int8 per 256 values and the dot products run in
integers (AVX512-VNNI where the CPU has it), so a row's result depends on that row
alone, never on the rest of the batch. Q8_0 takes the same path where the CPU has
AVX512-VNNI and K is a multiple of 256 (:meth:`QuantKernel.int8_activations`).

:meth:`QuantWeight.matmul` (``x @ W^T``) and :meth:`QuantWeight.rows` (the embedding
lookup) run ``csrc/quant_matmul.c``, built at first use like the other compiled kernels
(:mod:`tokenrelay.engine.kernels.build`): each weight is dequantized in registers,
exactly, and multiplied against the fp32 activations (K-quants: against int8
activations), so results match a product with the dequantized matrix up to float
rounding order. Where the kernel cannot be built, or ``TOKENRELAY_CPU_KERNELS=0``, the
same methods dequantize without it (torch ops; gguf-py for the K-quants) and call
``F.linear`` (slower, and it holds the fp32 matrix for the duration of the call).

The C side checks nothing: every shape, dtype and index is checked here first.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tokenrelay.core.runtime import env_switch
from tokenrelay.engine.kernels.build import BUILD_ERRORS, CSRC, ENV_SWITCH, load
from tokenrelay.engine.kernels.quant_formats import (
    BLOCK,
    KBLOCK,
    KQTYPES,
    QTYPES,
    dequantize_blocks,
)

log = logging.getLogger("tokenrelay.engine")

SOURCE = CSRC / "quant_matmul.c"
_FORMATS = {
    **{name: (tid, size, BLOCK) for name, (tid, size) in QTYPES.items()},
    **{name: (tid, size, KBLOCK) for name, (tid, size) in KQTYPES.items()},
}
# Q4_K repacked 16 rows at a time (engine/kernels/csrc/kquant_x16.c): our own type id,
# never in a file; bytes per group of 16 rows and 256 columns
Q4_KX_ID, Q4_KX_GROUP_BYTES = 112, 2368
QUANT_TYPES: tuple[str, ...] = tuple(_FORMATS)  # the names, for messages and membership
_BY_ID = {type_id: name for name, (type_id, _, _) in _FORMATS.items()}

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class QuantKernel:
    """The compiled library's two entry points, typed for ``ctypes``."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._matmul = library.tr_quant_matmul
        self._matmul.restype = ctypes.c_int
        self._matmul.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _int, _ptr, _i64]
        self._rows = library.tr_quant_rows
        self._rows.restype = ctypes.c_int
        self._rows.argtypes = [_ptr, _i64, _int, _ptr, _i64, _ptr]
        self._int8 = library.tr_quant_int8_activations
        self._int8.restype = ctypes.c_int
        self._int8.argtypes = [_int, _i64]
        self._kq_x = library.tr_kq_quantized_x
        self._kq_x.restype = ctypes.c_int
        self._kq_x.argtypes = [_ptr, _i64, _i64, _i64, _ptr]
        self._interleave = library.tr_kq_interleave
        self._interleave.restype = ctypes.c_int
        self._interleave.argtypes = [_ptr, _i64, _i64, _ptr]

    def interleave(self, w: QuantWeight) -> torch.Tensor | None:
        """A Q4_K ``w`` repacked 16 rows at a time (``Q4_KX_ID``, the AVX512-VNNI kernel's
        form, a copy), or ``None`` where this build or ``w``'s shape has none."""
        if w.qtype != "Q4_K" or w.n % 16 or w.k % KBLOCK:
            return None
        out = torch.empty(w.n // 16 * (w.k // KBLOCK) * Q4_KX_GROUP_BYTES, dtype=torch.uint8)
        return out if self._interleave(w.data_ptr, w.n, w.k, out.data_ptr()) == 0 else None

    def matmul(self, x: torch.Tensor, w: QuantWeight, y: torch.Tensor) -> None:
        """``y`` ``[M, N]`` (contiguous) = ``x @ W^T``; ``x`` ``[M, K]`` with contiguous rows.

        Shapes, dtypes and strides are checked by the caller (:meth:`QuantWeight.matmul`).
        """
        self.matmul_raw(x, w.data_ptr, w.n, w.type_id, y)

    def matmul_raw(self, x: torch.Tensor, w: int, n: int, type_id: int, y: torch.Tensor) -> None:
        """:meth:`matmul` for the blocks at address ``w`` of ``type_id`` (e.g. ``Q4_KX_ID``)."""
        rc = self._matmul(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), w, n, type_id,
                          y.data_ptr(), n)  # fmt: skip
        if rc == -2:
            raise MemoryError("quant matmul kernel: no memory for its panel scratch")
        if rc != 0:
            raise ValueError(f"quant matmul kernel: refused type {_BY_ID.get(type_id, type_id)}")

    def int8_activations(self, w: QuantWeight) -> bool:
        """Whether products with ``w`` quantize ``x`` to int8 per 256 values: the K-quants,
        and Q8_0 where the CPU has the int8 dot products and K is whole 256-blocks."""
        return bool(self._int8(w.type_id, w.k))

    def quantized_x(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` fp32 (K a multiple of 256) as the K-quant products see it: each
        value its int8 quantization times its block's scale (the exact input of a test's
        reference product)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % KBLOCK:
            raise ValueError(f"quantized_x: x must be fp32 [M, K], K a multiple of {KBLOCK}")
        x = x.contiguous()
        out = torch.empty_like(x)
        if x.numel() and self._kq_x(x.data_ptr(), x.shape[0], x.shape[1], x.shape[1],
                                    out.data_ptr()):  # fmt: skip
            raise MemoryError("quantized_x: no memory for its scratch")
        return out

    def rows(self, w: QuantWeight, ids: torch.Tensor, out: torch.Tensor) -> None:
        """``out[i]`` = row ``ids[i]`` of ``W``, dequantized; ids already checked."""
        rc = self._rows(w.data_ptr, w.k, w.type_id, ids.data_ptr(), ids.shape[0], out.data_ptr())
        if rc != 0:
            raise ValueError(f"quant rows kernel: refused qtype {w.qtype}")


@functools.cache
def quant_kernel() -> QuantKernel | None:
    """The compiled kernel, built on first call; ``None`` where disabled or not buildable."""
    if not env_switch(ENV_SWITCH):
        log.info("CPU kernels off", extra={"switch": ENV_SWITCH})
        return None
    try:
        return QuantKernel(load(SOURCE))
    except BUILD_ERRORS as exc:
        log.warning(
            "CPU quant kernel unavailable, dequantizing with torch instead",
            extra={"error": str(exc)[-500:]},
        )
        return None


def _qtype_name(qtype: str | int) -> str:
    """``"Q4_1"``, ``3`` or ``GGMLQuantizationType.Q4_1`` -> ``"Q4_1"``."""
    name = getattr(qtype, "name", None)  # an IntEnum like gguf's GGMLQuantizationType
    if isinstance(name, str) and name in _FORMATS:
        return name
    if isinstance(qtype, str) and qtype.upper() in _FORMATS:
        return qtype.upper()
    if isinstance(qtype, int) and not isinstance(qtype, bool) and qtype in _BY_ID:
        return _BY_ID[qtype]
    supported = ", ".join(QUANT_TYPES)
    raise ValueError(f"quant weight: unsupported qtype {qtype!r} (supported: {supported})")


class QuantWeight:
    """A weight matrix ``[N, K]`` kept in GGUF blocks (:data:`QUANT_TYPES`), CPU only.

    ``blocks`` is the uint8 tensor ``[N, K / block * block bytes]`` (a copy is made only
    when it is not contiguous: a view of a mapped file stays one); ``qtype`` a name from
    :data:`QUANT_TYPES`, a ggml type id or
    gguf's ``GGMLQuantizationType``. ``n`` and ``k``, when given, are checked against
    the blocks' shape. Refuses anything else with a ``ValueError``.
    """

    def __init__(
        self, blocks: torch.Tensor, qtype: str | int, n: int | None = None, k: int | None = None
    ) -> None:
        self.qtype = _qtype_name(qtype)
        self.type_id, self.block_bytes, self.block_weights = _FORMATS[self.qtype]
        if not isinstance(blocks, torch.Tensor):
            raise ValueError("quant weight: blocks must be a torch.Tensor (uint8)")
        if blocks.dtype != torch.uint8:
            raise ValueError(f"quant weight: blocks must be uint8, not {blocks.dtype}")
        if blocks.device.type != "cpu":
            raise ValueError("quant weight: blocks must be on the CPU")
        if blocks.dim() != 2:
            raise ValueError(f"quant weight: blocks must be 2-D [N, bytes], not {blocks.dim()}-D")
        rows, width = blocks.shape
        if width == 0 or width % self.block_bytes:
            raise ValueError(
                f"quant weight: a {self.qtype} row is a positive multiple of "
                f"{self.block_bytes} bytes, not {width}"
            )
        if n is not None and n != rows:
            raise ValueError(f"quant weight: blocks hold {rows} rows, not N={n}")
        holds = width // self.block_bytes * self.block_weights
        if k is not None and k != holds:
            raise ValueError(
                f"quant weight: rows of {width} bytes hold K={holds} {self.qtype} weights,"
                f" not K={k}"
            )
        self.blocks = blocks.contiguous()
        self.data_ptr = self.blocks.data_ptr()  # fixed: the blocks are never written
        self.n = int(rows)
        self.k = holds

    @classmethod
    def from_gguf(cls, tensor: Any) -> QuantWeight:
        """From a ``gguf.GGUFReader`` tensor (its ``data`` and ``tensor_type``), copied."""
        import numpy as np

        data = np.ascontiguousarray(tensor.data, dtype=np.uint8).copy()
        return cls(torch.from_numpy(data), tensor.tensor_type)

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``: output rows, input features."""
        return self.n, self.k

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks (what the weight costs in memory)."""
        return self.blocks.numel()

    def __repr__(self) -> str:
        return f"QuantWeight({self.qtype}, N={self.n}, K={self.k})"

    def matmul(self, x: torch.Tensor, *, use_kernel: bool = True) -> torch.Tensor:
        """``x`` ``[..., K]`` fp32 -> ``x @ W^T`` ``[..., N]`` fp32.

        ``use_kernel=False`` takes the torch path (dequantize, then ``F.linear``), as
        happens anyway when the compiled kernel is unavailable. A 2-D ``x`` whose rows
        are contiguous is read in place; other layouts are copied first.
        """
        # The decode path calls this a few hundred times a step: checks stay cheap.
        if (
            not isinstance(x, torch.Tensor)
            or x.dtype != torch.float32
            or not x.is_cpu
            or x.dim() == 0
            or x.shape[-1] != self.k
        ):
            self._refuse(x)
        kernel = quant_kernel() if use_kernel else None
        if kernel is None:
            return F.linear(x, self.dequantize(use_kernel=False))
        if x.dim() != 2:
            return self.matmul(x.reshape(-1, self.k)).reshape(*x.shape[:-1], self.n)
        if x.stride(1) != 1:  # rows may be strided, even overlapping: C only reads x
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32)
        if m and self.n:
            kernel.matmul(x, self, y)
        return y

    def _refuse(self, x: object) -> None:
        """Raise the ``ValueError`` that says what is wrong with ``x``."""
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
            raise ValueError("quant matmul: x must be an fp32 tensor")
        if not x.is_cpu:
            raise ValueError("quant matmul: x must be on the CPU")
        raise ValueError(f"quant matmul: x must be [..., {self.k}], not {list(x.shape)}")

    def _check_ids(self, ids: torch.Tensor | Sequence[int], what: str) -> torch.Tensor:
        index = torch.as_tensor(ids)
        if index.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise ValueError(f"quant {what}: row ids must be integers, not {index.dtype}")
        if index.dim() != 1:
            raise ValueError(f"quant {what}: row ids must be 1-D, not {index.dim()}-D")
        index = index.to(device="cpu", dtype=torch.int64).contiguous()
        if index.numel():
            lo, hi = (int(v) for v in index.aminmax())
            if lo < 0 or hi >= self.n:
                raise ValueError(f"quant {what}: a row id outside [0, {self.n})")
        return index

    def rows(self, ids: torch.Tensor | Sequence[int], *, use_kernel: bool = True) -> torch.Tensor:
        """Rows ``ids`` (1-D ints in ``[0, N)``) dequantized: fp32 ``[len(ids), K]``."""
        index = self._check_ids(ids, "rows")
        kernel = quant_kernel() if use_kernel else None
        if kernel is None:
            return dequantize_blocks(self.blocks[index], self.qtype)
        out = torch.empty(index.shape[0], self.k, dtype=torch.float32)
        if index.numel():
            kernel.rows(self, index, out)
        return out

    def dequantize(self, *, use_kernel: bool = True) -> torch.Tensor:
        """The whole matrix, fp32 ``[N, K]``."""
        if use_kernel and quant_kernel() is not None:
            return self.rows(torch.arange(self.n))
        return dequantize_blocks(self.blocks, self.qtype)

    def take_rows(self, index: torch.Tensor | Sequence[int]) -> QuantWeight:
        """A new weight of rows ``index`` of this one, in that order (a permutation, a slice).

        Rows are whole blocks, so this is exact: e.g. undoing llama.cpp's q/k row
        permutation.
        """
        return QuantWeight(self.blocks[self._check_ids(index, "take_rows")], self.qtype)

    @staticmethod
    def concat_rows(weights: Sequence[QuantWeight]) -> QuantWeight:
        """:func:`concat_rows`: stack weights with the same K and qtype by rows."""
        return concat_rows(weights)


def concat_rows(weights: Sequence[QuantWeight]) -> QuantWeight:
    """Stack weights with the same K and qtype by rows (fused q/k/v, gate/up)."""
    if not weights:
        raise ValueError("concat_rows: no weights")
    first = weights[0]
    for w in weights[1:]:
        if w.qtype != first.qtype or w.k != first.k:
            raise ValueError(
                f"concat_rows: {w.qtype} K={w.k} does not stack on {first.qtype} K={first.k}"
            )
    return QuantWeight(torch.cat([w.blocks for w in weights], dim=0), first.qtype)


class QuantStack:
    """A matrix ``[N, K]`` stacked by rows from quantized parts, each in its own type.

    A fused q/k/v or gate/up projection whose parts differ in type (a Q4_K_M file keeps
    some layers' v in Q6_K beside Q4_K q and k) or live apart in a mapped file: nothing
    is copied. :meth:`matmul` multiplies part by part; the fused decoder reads the
    parts in place (engine/kernels/decoder.py).
    """

    MAX_PARTS = 3  # what the fused decoder's C struct holds

    def __init__(self, parts: Sequence[QuantWeight]) -> None:
        if not parts:
            raise ValueError("quant stack: no parts")
        if len(parts) > self.MAX_PARTS:
            raise ValueError(f"quant stack: at most {self.MAX_PARTS} parts, not {len(parts)}")
        k = parts[0].k
        for w in parts:
            if not isinstance(w, QuantWeight) or w.k != k:
                raise ValueError(f"quant stack: every part must be a QuantWeight with K={k}")
        self.parts: tuple[QuantWeight, ...] = tuple(parts)
        self.n = sum(w.n for w in parts)
        self.k = k

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``: output rows (all parts), input features."""
        return self.n, self.k

    @property
    def nbytes(self) -> int:
        """Bytes of every part's blocks."""
        return sum(w.nbytes for w in self.parts)

    @property
    def qtypes(self) -> tuple[str, ...]:
        """Each part's type name."""
        return tuple(w.qtype for w in self.parts)

    def __repr__(self) -> str:
        return f"QuantStack({'+'.join(self.qtypes)}, N={self.n}, K={self.k})"

    def matmul(self, x: torch.Tensor, *, use_kernel: bool = True) -> torch.Tensor:
        """``x`` ``[..., K]`` fp32 -> ``x @ W^T`` ``[..., N]``: each part's product, joined."""
        outs = [w.matmul(x, use_kernel=use_kernel) for w in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def dequantize(self, *, use_kernel: bool = True) -> torch.Tensor:
        """The whole matrix, fp32 ``[N, K]``."""
        return torch.cat([w.dequantize(use_kernel=use_kernel) for w in self.parts])
