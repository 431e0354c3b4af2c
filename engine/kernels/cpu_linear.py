"""Matrix products on the CPU: oneDNN with each weight reordered once, at load time.

``F.linear`` on a CPU hands every call to MKL's sgemm, which re-packs the whole
weight matrix into its blocked layout on each call. For a decoder step that is
a pass over all the weights before any arithmetic, and for the small row counts
of decoding (1 to 64 rows) it dominates. oneDNN can keep a weight in its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``) and multiply against it
directly (``torch.ops.mkldnn._linear_pointwise``, the op PyTorch's own compiler
emits for frozen CPU linears). ``TOKENRELAY_PACKED_LINEAR=0|1 python -m
bench.engine_throughput --skip-hf`` measures the engine end to end both ways. Packing
costs a pass over every weight at load.

The packed weight replaces the dense one, so memory grows only by the tied LM
head (the embedding keeps its dense copy for the lookup). ``TOKENRELAY_PACKED_LINEAR=0``
turns this off; so do a non-CPU device, a dtype other than fp32, and a PyTorch
build without oneDNN.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from tokenrelay.core.runtime import env_switch

log = logging.getLogger("tokenrelay.engine")

# oneDNN picks its blocking from an expected row count; prefill chunks are large
# and measured best, and decode batches lose nothing against a smaller hint.
BATCH_HINT = 1024
ENV_SWITCH = "TOKENRELAY_PACKED_LINEAR"


@runtime_checkable
class MatmulWeight(Protocol):
    """A weight kept in its own format that multiplies itself (a quantized matrix)."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, in]`` fp32 -> ``x @ W^T`` ``[N, out]`` fp32."""
        ...


# What a module keeps in place of a dense weight: oneDNN's blocked copy, or a weight
# that multiplies itself (engine/kernels/quant.py).
Prepared = torch.Tensor | MatmulWeight


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True where :func:`pack` applies: fp32 on a CPU with oneDNN, not disabled by env."""
    if not env_switch(ENV_SWITCH):
        return False
    if device.type != "cpu" or dtype != torch.float32:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    mkldnn = torch.ops.mkldnn
    return hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` (dense fp32) -> the same matrix in oneDNN's blocked layout."""
    with torch.inference_mode():
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: Prepared | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` ``[N, in]`` -> ``[N, out]``: through ``packed`` if given, else ``F.linear``."""
    if packed is None:
        return F.linear(x, weight, bias)
    if not isinstance(packed, torch.Tensor):
        y = packed.matmul(x)
        return y if bias is None else y + bias
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def placeholder(like: torch.Tensor) -> torch.nn.Parameter:
    """An empty parameter to stand where a dense weight was packed (keeps the module tree)."""
    return torch.nn.Parameter(like.new_empty(0), requires_grad=False)
