"""The ``triton`` backend: our Triton kernels reading K/V from the blocks in place.

:mod:`tokenrelay.engine.kernels.triton_attention` has a decode kernel (one query token per
sequence, the query heads of a KV head together) and a varlen prefill kernel
(chunks with a cached prefix, mixed with decode rows). Both read only the
metadata's tensors, so CUDA graphs can replay a decode step. On a GPU they are
compiled; on CPU tensors they run under Triton's interpreter
(``TRITON_INTERPRET=1``), which is how the tests check them without a GPU. A layer's
sliding window and soft-capping are arguments of both kernels (the same on every step).
"""

from __future__ import annotations

import torch

from tokenrelay.engine.attention.backend import AttentionBackend
from tokenrelay.engine.attention.metadata import AttentionMetadata


class TritonBackend(AttentionBackend):
    """Paged decode and prefill kernels of our own, in Triton."""

    name = "triton"
    graph_safe = True

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        import tokenrelay.engine.kernels.triton_attention as triton_attention

        self._kernels = triton_attention

    def forward(
        self,
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
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.all_decode:  # one row per sequence, in sequence order
            return self._kernels.paged_decode(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, out,
                window=window, softcap=softcap,
            )  # fmt: skip
        return self._kernels.paged_prefill(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.context_lens,
            meta.max_seqlen_q,
            scale,
            out,
            window=window,
            softcap=softcap,
        )
