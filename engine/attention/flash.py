"""The ``flash-attn`` backend: flash-attn 2's paged-KV kernels (CUDA, fp16/bf16).

Decode batches go to ``flash_attn_with_kvcache`` and mixed batches to
``flash_attn_varlen_func``, both with a ``block_table`` into the pool, so K/V are
read in place. flash-attn 2 needs paged blocks of a multiple of
``registry.FLASH_BLOCK_MULTIPLE`` tokens; the registry sets that block size itself.
Reads only the metadata's tensors: CUDA graphs can replay its decode steps. A layer's
sliding window and soft-capping go to flash-attn's own ``window_size`` and ``softcap``
(flash-attn 2.6 and later).
"""

from __future__ import annotations

import torch

from tokenrelay.engine.attention.backend import AttentionBackend
from tokenrelay.engine.attention.metadata import AttentionMetadata


class FlashBackend(AttentionBackend):
    """flash-attn 2 over the block pool (``block_table``)."""

    name = "flash-attn"
    graph_safe = True

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._with_kvcache = flash_attn_with_kvcache
        self._varlen = flash_attn_varlen_func

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
        # flash-attn's window: (keys left of the query, right of it); -1: unbounded
        layer: dict[str, object] = {"window_size": (-1, -1) if window is None else (window - 1, 0)}
        if softcap is not None:
            layer["softcap"] = softcap
        if meta.all_decode:
            out = self._with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.context_lens,
                block_table=meta.block_tables,
                softmax_scale=scale,
                causal=True,
                **layer,
            )  # [B, 1, H, D]
            return out.squeeze(1)
        return self._varlen(
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
            **layer,
        )
