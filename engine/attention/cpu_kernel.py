"""The ``cpu`` backend: decode rows through the compiled C kernel, prefill through SDPA.

``engine/kernels/csrc/paged_attention.c`` (:mod:`tokenrelay.engine.kernels.cpu_attention`) reads
K and V out of the blocks where they are, for every decode row of the step in one
call per layer (a layer's sliding window and soft-capping included); prefill chunks take
the torch backend's SDPA path. It computes in
fp32; the pool may be fp32 or fp16 (both paths read fp16 K/V back into fp32).
Where the kernel did not build (no compiler, ``TOKENRELAY_CPU_KERNELS=0``) the
backend is the torch one under this name, as the build logged. A runner serving
GGUF blocks as they are bypasses this module: its fused decoder
(``csrc/decoder.c``) attends with the same C kernel inside the step.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenrelay.engine.attention.backend import HostBatch
from tokenrelay.engine.attention.metadata import AttentionMetadata
from tokenrelay.engine.attention.torch_sdpa import TorchBackend, TorchPlan
from tokenrelay.engine.kernels.cpu_attention import DecodeBatch, PagedDecode


class CpuBackend(TorchBackend):
    """The torch backend with its decode rows handed to the compiled kernel."""

    name = "cpu"

    def __init__(self, device: torch.device, dtype: torch.dtype, kernel: PagedDecode | None):
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"attention_backend=cpu runs on the CPU in float32, not {device} "
                             f"{str(dtype).replace('torch.', '')}")  # fmt: skip
        super().__init__(device, dtype)
        self.kernel = kernel

    def plan(self, meta: AttentionMetadata, host: HostBatch) -> None:
        if self.kernel is None:
            super().plan(meta, host)
            return
        plan = TorchPlan()
        meta.plan = plan
        rows = np.nonzero(host.q_lens == 1)[0]
        if len(rows):  # one call per layer for every decode row, in place
            plan.kernel_batch = self.kernel.plan(
                meta.block_tables,
                meta.context_lens,
                torch.from_numpy(host.cu_q[rows]),
                torch.from_numpy(rows.astype(np.int64)),
                meta.block_size,
            )
        self._plan_prefill(meta, plan, host)

    def _decode_rows(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: TorchPlan,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> None:
        if isinstance(plan.kernel_batch, DecodeBatch) and self.kernel is not None:
            self.kernel(q, out, k_cache, v_cache, plan.kernel_batch, scale, window, softcap)
        super()._decode_rows(q, out, k_cache, v_cache, plan, scale, window, softcap)
