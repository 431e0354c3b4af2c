"""Where and in what a runner computes: the device, the compute and KV dtypes by name,
and the CPU threads, each validated with a clear ``ValueError``."""

from __future__ import annotations

import os

import torch

from tokenrelay.engine.models.weights import default_dtype


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; validates anything else."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {device!r} is not a torch device") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {device!r} is not supported (cpu, cuda or auto)")
    return dev


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """``None``/``"auto"`` -> fp32 on CPU, bf16 (or fp16) on CUDA; accepts names like ``"bf16"``."""
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"dtype: {dtype!r} is not supported (float32, bfloat16, float16 or auto)")


def kv_dtype_name(kv_cache_dtype: torch.dtype | str | None) -> str:
    """``None``/``"auto"`` -> ``"auto"``; a dtype or its name (``"fp16"``...) -> its full name."""
    if kv_cache_dtype is None or kv_cache_dtype == "auto":
        return "auto"
    if kv_cache_dtype in DTYPES.values() or str(kv_cache_dtype).lower() in DTYPES:
        return str(resolve_dtype(kv_cache_dtype, torch.device("cpu"))).replace("torch.", "")
    supported = "auto, float32, float16 or bfloat16"
    raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not supported ({supported})")


def configure_threads(num_threads: int | None = None) -> int:
    """Use ``num_threads``, else honour ``OMP_NUM_THREADS``/torch's default, capped at our CPUs."""
    if num_threads is not None:
        if num_threads <= 0:
            raise ValueError(f"num_threads must be > 0, got {num_threads}")
        torch.set_num_threads(num_threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        if available and torch.get_num_threads() > available:
            torch.set_num_threads(available)
    return torch.get_num_threads()
