"""A whole decoder step in one C call, for models whose projections are quantized.

``csrc/decoder.c`` runs every layer of a decoder (norms, the quantized projections of
``csrc/quant_matmul.c``, rotary, the KV-cache write, the paged attention of
``csrc/paged_attention.c``, the gated MLP, residuals) for a flattened batch of tokens, so
a step costs one ``ctypes`` call instead of ~15 PyTorch ops per layer. At one sequence the
per-op overhead was as large as the matrix products (docs/benchmarks.md, "Engine profile").

The layer is Llama's with what the other families change as data: a missing input
norm, norms on the sublayers' outputs, q/k norms per head or over the whole projection,
partial rotary and a second rotary table for some layers, per-layer sliding windows,
soft-capped attention scores, a residual multiplier, SiLU or tanh-GELU (:class:`Shape`,
:class:`LayerWeights`). Each family says how its layers map onto it
(``engine/models``: ``Layer.fused_weights``, ``CausalLM.fused_shape``).

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
from dataclasses import dataclass

import torch

from tokenrelay.core.runtime import env_switch
from tokenrelay.engine.kernels.build import BUILD_ERRORS, CSRC, ENV_SWITCH, load
from tokenrelay.engine.kernels.decoder_abi import (
    REPACK_SWITCH,
    CLayer,
    CModel,
    CStep,
    Projection,
    Repacker,
    qmat,
    vector,
)
from tokenrelay.engine.kernels.quant import QuantWeight

__all__ = ["REPACK_SWITCH", "FusedDecoder", "LayerWeights", "Projection", "Shape"]

log = logging.getLogger("tokenrelay.engine")

SOURCE = CSRC / "decoder.c"
FUSED_SWITCH = "TOKENRELAY_FUSED_DECODER"  # 0: the PyTorch decoder, kernel by kernel
# Fewer rows than this many per thread: split each row's KV heads over attention tasks too
# (as engine/kernels/cpu_attention.py).
ROWS_PER_THREAD_FOR_WHOLE_HEADS = 4
KV_DTYPES = (torch.float16, torch.float32)  # what bind_cache() takes


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights as the fused step reads them.

    Every norm is a plain RMSNorm ``x / rms(x) * w`` (a family whose norms scale by
    ``1 + w`` passes ``1 + w``); the optional ones are left out where ``None``.
    """

    input_norm: torch.Tensor | None  # [hidden]; None: attention reads the residual itself
    qkv: Projection  # [(H + 2 Hkv) D, hidden]
    o: Projection  # [hidden, H D]
    post_norm: torch.Tensor | None  # [hidden], the norm before the MLP
    gate_up: Projection  # [2 I, hidden]
    down: Projection  # [hidden, I]
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [D], or [H D] where Shape.qk_norm_whole; with k_norm
    k_norm: torch.Tensor | None = None  # [D], or [Hkv D]
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # [hidden], on the attention's output
    mlp_out_norm: torch.Tensor | None = None  # [hidden], on the MLP's output
    window: int | None = None  # attends to the last ``window`` tokens only
    local_rope: bool = False  # rotates with the step's second (local) table


ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's nonlinearity, by its C id


@dataclass(frozen=True)
class Shape:
    """The decoder's dimensions and the scalars every layer shares."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float  # attention's softmax scale
    rotary_dim: int | None = None  # values of each head rotated (None: all of them)
    qk_norm_whole: bool = False  # q/k norms over the whole projection (OLMo 2)
    activation: str = "silu"  # one of ACTIVATIONS
    residual_scale: float = 1.0  # each sublayer's output times this (Granite)
    softcap: float | None = None  # attention scores soft-capped (Gemma 2)

    @property
    def rot(self) -> int:
        """The rotated values of each head."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim


class FusedDecoder:
    """Every layer of one model in one C call per step (fp32 activations, CPU)."""

    def __init__(self, library: ctypes.CDLL, shape: Shape, layers: list[LayerWeights],
                 final_norm: torch.Tensor, head: QuantWeight | None = None) -> None:  # fmt: skip
        fn = library.tr_decoder_forward
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(CModel), ctypes.POINTER(CStep), ctypes.c_void_p]
        self._fn = fn
        self.shape = s = shape
        if s.head_dim % 2 or s.num_heads % s.num_kv_heads:
            raise ValueError("fused decoder: head_dim must be even, heads a multiple of KV heads")
        if s.rot % 2 or not 2 <= s.rot <= s.head_dim or s.activation not in ACTIVATIONS:
            raise ValueError(
                f"fused decoder: rotary_dim {s.rot} must be even and <= head_dim, the "
                f"activation one of {ACTIVATIONS}"
            )
        qkv_n = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        q_norm_n = s.num_heads * s.head_dim if s.qk_norm_whole else s.head_dim
        k_norm_n = s.num_kv_heads * s.head_dim if s.qk_norm_whole else s.head_dim
        keep: list[object] = []  # every tensor whose memory the C side reads

        def ptr(t: torch.Tensor | None, n: int, what: str) -> int | None:
            v = vector(t, n, what)
            if v is None:
                return None
            keep.append(v)
            return v.data_ptr()

        repack = Repacker()
        structs = []
        for i, lw in enumerate(layers):
            if (lw.q_norm is None) != (lw.k_norm is None):
                raise ValueError(f"fused decoder: layer {i} has only one of q_norm and k_norm")
            keep.extend((lw.qkv, lw.o, lw.gate_up, lw.down))
            if lw.window is not None and lw.window < 1:
                raise ValueError(f"fused decoder: layer {i} has window {lw.window}")
            structs.append(CLayer(
                ptr(lw.input_norm, s.hidden, "input_norm"),
                qmat(lw.qkv, qkv_n, s.hidden, "qkv", repack),
                ptr(lw.qkv_bias, qkv_n, "qkv_bias"),
                ptr(lw.q_norm, q_norm_n, "q_norm"),
                ptr(lw.k_norm, k_norm_n, "k_norm"),
                qmat(lw.o, s.hidden, s.num_heads * s.head_dim, "o", repack),
                ptr(lw.o_bias, s.hidden, "o_bias"),
                ptr(lw.attn_out_norm, s.hidden, "attn_out_norm"),
                ptr(lw.post_norm, s.hidden, "post_norm"),
                qmat(lw.gate_up, 2 * s.intermediate, s.hidden, "gate_up", repack),
                ptr(lw.gate_up_bias, 2 * s.intermediate, "gate_up_bias"),
                qmat(lw.down, s.hidden, s.intermediate, "down", repack),
                ptr(lw.down_bias, s.hidden, "down_bias"),
                ptr(lw.mlp_out_norm, s.hidden, "mlp_out_norm"),
                lw.window or 0,
                int(lw.local_rope),
            ))  # fmt: skip
        self.local_rope = any(lw.local_rope for lw in layers)  # forward() needs its table
        self._layers = (CLayer * len(structs))(*structs)
        self._model = CModel(
            len(structs), s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate,
            s.eps, s.scale, self._layers, ptr(final_norm, s.hidden, "final_norm"),
        )  # fmt: skip
        m = self._model
        m.rot_dim, m.qk_norm_whole = s.rot, int(s.qk_norm_whole)
        m.act, m.residual_scale = ACTIVATIONS.index(s.activation), s.residual_scale
        m.softcap = s.softcap or 0.0
        # the LM head, if quantized: a step can end with every row's logits
        self.vocab = head.n if isinstance(head, QuantWeight) else None
        if isinstance(head, QuantWeight):
            self._model.head = qmat(head, head.n, s.hidden, "head", repack)
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
        local: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run every layer and the final norm on ``x`` ``[T, hidden]`` in place; returns it.

        ``cos``/``sin`` ``[T, R/2]`` fp32 (R: ``Shape.rot``), and ``local`` the same for the
        layers that rotate with a local table; ``slots`` ``[T]`` int64 KV slot of each token;
        ``tables`` ``[B, max_blocks]`` int32; ``seqs`` ``[T]`` int64 each token's row of
        ``tables``; ``lens`` ``[T]`` int32 tokens each one attends to (position + 1).
        ``logits``: a contiguous fp32 ``[T, vocab]`` the step fills with every row's
        logits through the LM head (only when built with one: :attr:`vocab`).
        """
        kv = self.kv
        if kv is None:
            raise RuntimeError("fused decoder: bind_cache() was not called")
        t = x.shape[0]
        half = self.shape.rot // 2
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape != (t, self.shape.hidden):
            raise ValueError("fused decoder: x must be contiguous fp32 [T, hidden]")
        if self.local_rope and local is None:
            raise ValueError("fused decoder: local layers need the local cos/sin table")
        cos, sin = cos.reshape(t, half).contiguous(), sin.reshape(t, half).contiguous()
        cos_l, sin_l = (
            (cos, sin) if local is None
            else (local[0].reshape(t, half).contiguous(), local[1].reshape(t, half).contiguous())
        )  # fmt: skip
        slots, seqs = slots.contiguous(), seqs.contiguous()
        tables, lens = tables.contiguous(), lens.contiguous()
        rows = torch.arange(t, dtype=torch.int64)
        if t:
            num_slots = kv.shape[2] * kv.shape[3]
            checks: tuple[tuple[bool, str], ...] = (
                (
                    all(v.dtype == torch.float32 for v in (cos, sin, cos_l, sin_l)),
                    "cos/sin must be fp32",
                ),
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
        step = CStep(
            t, cos.data_ptr(), sin.data_ptr(), cos_l.data_ptr(), sin_l.data_ptr(),
            slots.data_ptr(), tables.data_ptr(),
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
