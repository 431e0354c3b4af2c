"""Which attention backend a runner uses: names, availability, block sizes.

=============  ==========================================  ============================
name           where                                       block size
=============  ==========================================  ============================
``cpu``        CPU, float32: the compiled C decode kernel  any (default 16)
``torch``      anywhere: SDPA over gathered blocks         any (default 16)
``triton``     CUDA (or CPU tensors with                   any power of two (default 16)
               ``TRITON_INTERPRET=1``): our Triton kernels
``flash-attn`` CUDA, fp16/bf16, ``flash_attn`` installed   a multiple of 256 (default 256)
=============  ==========================================  ============================

``auto`` picks flash-attn where it is installed, else triton on CUDA, else cpu
(torch on a CPU computing in half precision). A backend that cannot run where it
was asked for is a ``ValueError`` naming what is missing, before any weight loads.
The names and checks are torch-free; :func:`create` imports the backend itself.

The KV pool holds the compute dtype, or float16 under float32 compute where the
reader converts (:func:`kv_cache_dtype`): the fused decoder and the ``cpu`` and
``torch`` backends read float16 K/V back into float32; triton and flash-attn read
the pool in the compute dtype only.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tokenrelay.engine.attention.backend import AttentionBackend

BACKENDS = ("auto", "cpu", "torch", "triton", "flash-attn")
DEFAULT_BLOCK_SIZE = 16
FLASH_BLOCK_MULTIPLE = 256  # flash-attn 2's paged-KV block sizes are multiples of this
GRAPH_SAFE = ("triton", "flash-attn")  # backends a CUDA graph can replay


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def triton_interpreted() -> bool:
    """Whether Triton kernels run under its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def choose(name: str, device_type: str, dtype: str) -> str:
    """The backend ``name`` means on ``device_type`` (``cpu``/``cuda``) computing in ``dtype``.

    ``dtype`` is ``float32``, ``bfloat16`` or ``float16``. Resolves ``auto``; raises
    ``ValueError`` for an unknown name or a backend that cannot run there.
    """
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    cuda = device_type == "cuda"
    if name == "auto":
        if cuda:
            if _installed("flash_attn") and dtype != "float32":
                return "flash-attn"
            return "triton" if _installed("triton") else "torch"
        return "cpu" if dtype == "float32" else "torch"
    if name == "cpu" and (cuda or dtype != "float32"):
        raise ValueError(
            f"attention_backend=cpu runs on the CPU in float32, not on {device_type} in {dtype}"
        )
    if name == "triton":
        if not _installed("triton"):
            raise ValueError("attention_backend=triton: the triton package is not installed")
        if not cuda and not triton_interpreted():
            raise ValueError(
                "attention_backend=triton needs a CUDA device (or TRITON_INTERPRET=1 to run "
                "the kernels on the CPU, slowly, as the tests do)"
            )
    if name == "flash-attn":
        if not cuda:
            raise ValueError("attention_backend=flash-attn needs a CUDA device")
        if not _installed("flash_attn"):
            raise ValueError(
                "attention_backend=flash-attn: the flash_attn package is not installed "
                "(pip install flash-attn --no-build-isolation, or use triton)"
            )
        if dtype == "float32":
            raise ValueError("attention_backend=flash-attn computes in bfloat16 or float16")
    return name


KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
# backends that read a float16 pool under float32 compute (the fused decoder runs with cpu)
F16_KV_BACKENDS = ("cpu", "torch")


def kv_cache_dtype(requested: str, backend: str, dtype: str, fused: bool = False) -> str:
    """The KV pool's dtype for ``requested`` (one of :data:`KV_CACHE_DTYPES`).

    ``backend`` is the resolved attention backend, ``dtype`` the compute dtype
    (``float32``, ``bfloat16``, ``float16``), ``fused`` whether the fused C decoder runs
    the layers. ``auto``: float16 with the fused decoder, else ``dtype``. An explicit
    dtype is the compute dtype, or float16 under float32 compute with a backend of
    :data:`F16_KV_BACKENDS`; anything else is a ``ValueError`` saying what is supported.
    """
    if requested not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {requested!r}"
        )
    if requested == "auto":
        return "float16" if fused else dtype
    if requested == dtype:
        return requested
    if requested == "float16" and dtype == "float32" and backend in F16_KV_BACKENDS:
        return requested
    raise ValueError(
        f"kv_cache_dtype={requested} does not run with attention backend {backend} computing "
        f"in {dtype}: the KV pool holds the compute dtype, or float16 under float32 compute "
        f"with the {' or '.join(F16_KV_BACKENDS)} backend (the fused decoder's); bfloat16 "
        "only where the model computes in bfloat16"
    )


def block_size_for(backend: str, requested: int | None) -> int:
    """The KV block size for a resolved ``backend``: ``requested``, else its default.

    flash-attn needs a multiple of ``FLASH_BLOCK_MULTIPLE`` (its default); a requested
    size it cannot use is a ``ValueError``.
    """
    if backend == "flash-attn":
        if requested is None:
            return FLASH_BLOCK_MULTIPLE
        if requested % FLASH_BLOCK_MULTIPLE:
            raise ValueError(
                f"block_size: flash-attn needs a multiple of {FLASH_BLOCK_MULTIPLE}, "
                f"got {requested}"
            )
    return DEFAULT_BLOCK_SIZE if requested is None else requested


def create(backend: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """A new instance of the resolved ``backend`` for a runner on ``device`` in ``dtype``."""
    if backend == "cpu":
        from tokenrelay.engine.attention.cpu_kernel import CpuBackend
        from tokenrelay.engine.kernels.cpu_attention import paged_decode

        return CpuBackend(device, dtype, paged_decode())
    if backend == "torch":
        from tokenrelay.engine.attention.torch_sdpa import TorchBackend

        return TorchBackend(device, dtype)
    if backend == "triton":
        from tokenrelay.engine.attention.triton_paged import TritonBackend

        return TritonBackend(device, dtype)
    if backend == "flash-attn":
        from tokenrelay.engine.attention.flash import FlashBackend

        return FlashBackend(device, dtype)
    raise ValueError(f"attention_backend: {backend!r} is not a resolved backend name")
