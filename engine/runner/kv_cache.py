"""The KV block pool: allocated once from a memory budget, never per request.

Per layer, keys and values are ``[num_blocks, block_size, num_kv_heads, head_dim]``
(flash-attn's paged layout), in the dtype the runner picks (``kv_cache_dtype``: float16
under the fused CPU decoder, else the compute dtype; engine/attention/registry.py), which
also sets how many blocks a byte budget holds. Which block belongs to which sequence is
the block manager's business; this module only owns the memory.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tokenrelay.core.runtime import available_memory, env_switch
from tokenrelay.engine.models.config import ModelConfig

log = logging.getLogger("tokenrelay.engine")

GIB = 1024**3
# The default pool on CPU is sized in tokens, like llama.cpp's -c, so it follows the model
# and the pool's dtype (float16 takes half float32's bytes): room for several full
# conversations at once, at most a share of the memory available at start. Its pages are
# touched only as blocks are first used (KVCache).
CPU_DEFAULT_TOKENS = 16384
CPU_MEMORY_SHARE = 0.25
# TOKENRELAY_KV_LAZY=0: write the whole CPU pool at start (resident from the first step, as
# llama.cpp's), e.g. for a soak that watches the worker's memory for leaks
LAZY_SWITCH = "TOKENRELAY_KV_LAZY"
GPU_MEMORY_FRACTION = 0.85  # share of free GPU memory (after weights) for the pool...
GPU_ACTIVATION_RESERVE_GIB = 1.0  # ...minus this much kept for activations


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (keys and values)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def plan_num_blocks(
    cfg: ModelConfig,
    *,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_memory_gib: float | None = None,
    num_blocks: int | None = None,
) -> int:
    """How many blocks the pool gets.

    ``num_blocks`` wins when given; else ``kv_cache_memory_gib``; else on CUDA
    ``GPU_MEMORY_FRACTION`` of free memory minus an activation reserve, and on CPU
    ``CPU_DEFAULT_TOKENS`` tokens of this model's KV, or fewer where that is more than
    ``CPU_MEMORY_SHARE`` of the memory available.
    """
    if num_blocks is not None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        return num_blocks
    per_block = block_bytes(cfg, block_size, dtype)
    if kv_cache_memory_gib is not None:
        if isinstance(kv_cache_memory_gib, bool) or not kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {kv_cache_memory_gib!r}")
        budget = float(kv_cache_memory_gib) * GIB
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = free * GPU_MEMORY_FRACTION - GPU_ACTIVATION_RESERVE_GIB * GIB
    else:
        budget = float(-(-CPU_DEFAULT_TOKENS // block_size) * per_block)
        avail = available_memory()
        if avail is not None and budget > avail * CPU_MEMORY_SHARE:
            budget = avail * CPU_MEMORY_SHARE
        log.info(
            "KV pool sized",
            extra={"tokens": int(budget // per_block) * block_size, "default_tokens":
                   CPU_DEFAULT_TOKENS, "dtype": str(dtype).replace("torch.", ""),
                   "gib": round(budget / GIB, 3), "available_gib": None if avail is None
                   else round(avail / GIB, 2)},
        )  # fmt: skip
    blocks = int(budget // per_block)
    if blocks <= 0:
        raise ValueError(
            f"kv_cache_memory: {budget / GIB:.3f} GiB holds no block of {per_block} bytes"
        )
    return blocks


def zeros_untouched(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages the OS maps in only when first written.

    ``torch.zeros`` writes every byte, so a pool is resident in full from the start;
    ``calloc`` (numpy's zeros) takes fresh zero pages from the OS for a large block and
    writes none. A block the engine never uses costs no memory.
    """
    count = 1
    for d in shape:
        count *= d
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(max(nbytes, 1), dtype=np.uint8))[:nbytes]
    return raw.view(dtype).reshape(shape)


class KVCache:
    """One pool of blocks per layer, allocated once (zeroed: padded reads stay finite;
    on the CPU resident only as blocks are used)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # [layers, 2, num_blocks, block_size, Hkv, D] in one allocation
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        if device.type == "cpu" and env_switch(LAZY_SWITCH):
            self.data = zeros_untouched(shape, dtype)
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.k: list[torch.Tensor] = [self.data[i, 0] for i in range(cfg.num_layers)]
        self.v: list[torch.Tensor] = [self.data[i, 1] for i in range(cfg.num_layers)]
        log.info(
            "KV cache allocated",
            extra={
                "num_blocks": num_blocks,
                "block_size": block_size,
                "dtype": str(dtype).replace("torch.", ""),
                "gib": round(self.data.numel() * self.data.element_size() / GIB, 3),
            },
        )

    @property
    def num_slots(self) -> int:
        """Token capacity of the whole pool."""
        return self.num_blocks * self.block_size
