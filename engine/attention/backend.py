"""The interface every attention backend implements (see engine/attention/registry.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

if TYPE_CHECKING:
    from tokenrelay.engine.attention.metadata import AttentionMetadata


@dataclass
class HostBatch:
    """The step's batch as host arrays, for backends that plan on the CPU (``needs_plan``)."""

    q_lens: np.ndarray  # [B] int64 query tokens per sequence
    starts: np.ndarray  # [B] int64 tokens already cached before this step
    ctx: np.ndarray  # [B] int64 tokens in the cache after this step
    cu_q: np.ndarray  # [B + 1] int64 row offsets of each sequence in the flat batch
    block_tables: np.ndarray  # [B, W] int64, padded with 0


class AttentionBackend(ABC):
    """Attends over the paged KV pool for one step's flattened varlen batch.

    One instance per model runner (it may keep buffers across steps). ``plan`` runs
    once per step, before the layers; ``forward`` once per layer, after the step's
    K/V were written into the pool.
    """

    name: ClassVar[str]
    # forward reads only the metadata's tensors (no per-step host plan, no sync):
    # a CUDA graph captured once can replay it with new tensor contents
    graph_safe: ClassVar[bool] = False
    # plan() wants the batch as host arrays (HostBatch)
    needs_plan: ClassVar[bool] = False

    def plan(self, meta: AttentionMetadata, host: HostBatch) -> None:  # noqa: B027
        """Prepare this step's per-backend plan (stored on ``meta.plan``); default: none."""

    @abstractmethod
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
        """``q`` ``[T, H, D]`` (this step's ``k``/``v`` ``[T, Hkv, D]`` already in the pool,
        ``k_cache``/``v_cache`` ``[num_blocks, block_size, Hkv, D]``) -> ``[T, H, D]``.

        ``window`` (a layer's sliding window, Gemma's local layers): a query at position
        ``p`` sees only the keys at ``p - window + 1 .. p``; ``None``: the whole causal
        prefix. ``softcap``: each score ``s`` (``scale`` applied) becomes
        ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2); ``None``: as it is.
        """
