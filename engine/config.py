"""Engine configuration, validated on construction (torch-free)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from tokenrelay.core import runtime
from tokenrelay.engine.attention.registry import BACKENDS, choose, kv_cache_dtype
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.store import locate_model
from tokenrelay.engine.parallel.layout import check_tensor_parallel

log = logging.getLogger("tokenrelay.engine")

DTYPES = {
    "auto": None,
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
# How the weights are held: "native" keeps a GGUF file's quantized blocks (CPU);
# "fp32"/"bf16" dequantize into dense tensors of that dtype; "auto" is native for a GGUF
# on the CPU in fp32 whose tensor types the kernels multiply, dense otherwise.
WEIGHTS = ("auto", "native", "fp32", "bf16")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
CPU_BATCHED_TOKENS = 1024
GPU_BATCHED_TOKENS = 8192
# prompt tokens a CPU step computes beside running decodes: a long prompt's chunk then
# delays the streams' next token by a few hundred milliseconds, not by a 1024-token chunk
CPU_PREFILL_WHILE_DECODING = 256


# weights auto dequantizes a GGUF the kernels cannot multiply only into at most this share
# of the memory available at start; beyond it the start is refused, in one line
DENSE_SHARE = 0.5


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass
class EngineConfig:
    """Everything :class:`engine.LLMEngine` needs to start.

    ``model`` is ``"default"``, a local Hugging Face folder or a ``.gguf`` file;
    an unknown one fails here, fast; nothing is converted until the engine
    that uses this config loads it. ``max_num_batched_tokens`` and
    ``max_model_len`` left as ``None`` are filled in by the engine (from the
    device and the model). ``num_blocks`` overrides the memory-based KV pool
    size (tests use it to force preemption).
    """

    model: str = "default"
    device: str = "auto"
    dtype: str | None = None  # None/"auto": fp32 on CPU, bf16 (or fp16) on CUDA
    block_size: int | None = None  # None: the attention backend's (16; flash-attn 256)
    kv_cache_memory: float | None = None  # GiB for the KV pool
    # the pool's element type: "auto" (float16 under the fused C decoder, else the compute
    # dtype), "float32", "float16" or "bfloat16" (engine/attention/registry.py)
    kv_cache_dtype: str = "auto"
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # per-step token budget
    # prompt tokens of a step that also decodes (None: 256 on the CPU, the budget on CUDA)
    max_prefill_while_decoding: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    weights: str = "auto"
    attention_backend: str = "auto"  # engine/attention/registry.py
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    # ranks the model is split over (engine/parallel/): gloo on the CPU, NCCL over N GPUs
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model, str | Path) or not str(self.model).strip():
            raise ValueError(f"model must be a name or a path, got {self.model!r}")
        self.model = str(self.model)
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            raise ValueError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        if self.dtype is not None:
            if not isinstance(self.dtype, str) or self.dtype.lower() not in DTYPES:
                raise ValueError(
                    f"dtype must be one of {sorted(set(DTYPES))} or None, got {self.dtype!r}"
                )
            self.dtype = DTYPES[self.dtype.lower()]
        if self.block_size is not None:
            _check_int("block_size", self.block_size, 1)
            if self.block_size & (self.block_size - 1):
                raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype.lower() not in DTYPES:
            raise ValueError(
                "kv_cache_dtype must be auto, float32, float16 or bfloat16, "
                f"got {self.kv_cache_dtype!r}"
            )
        self.kv_cache_dtype = DTYPES[self.kv_cache_dtype.lower()] or "auto"
        if self.device == "cpu":  # no torch needed to know a backend cannot run there
            choose(self.attention_backend, "cpu", self.dtype or "float32")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a boolean, got {self.enforce_eager!r}")
        if self.kv_cache_memory is not None:
            bad = isinstance(self.kv_cache_memory, bool) or not isinstance(
                self.kv_cache_memory, int | float
            )
            if bad or not self.kv_cache_memory > 0:
                got = self.kv_cache_memory
                raise ValueError(f"kv_cache_memory must be a positive number of GiB, got {got!r}")
            self.kv_cache_memory = float(self.kv_cache_memory)
        if self.num_blocks is not None:
            _check_int("num_blocks", self.num_blocks, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_num_batched_tokens is not None:
            _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_prefill_while_decoding is not None:
            _check_int("max_prefill_while_decoding", self.max_prefill_while_decoding, 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be a boolean, got {self.enable_prefix_caching!r}"
            )
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.weights in ("fp32", "bf16"):
            wanted = DTYPES[self.weights]
            if self.dtype not in (None, wanted):
                raise ValueError(f"weights={self.weights} contradicts dtype={self.dtype}")
            self.dtype = wanted
        if self.weights == "native" and self.dtype not in (None, "float32"):
            raise ValueError("weights=native computes in float32; leave dtype unset")
        if self.device == "cpu":  # the pool's dtype against the backend, as the runner will
            compute = self.dtype or "float32"
            kv_cache_dtype(
                self.kv_cache_dtype, choose(self.attention_backend, "cpu", compute), compute
            )
        # Raises ModelNotFoundError (a ValueError starting with "model:") for unknown models.
        ready, gguf, _ = locate_model(self.model)
        if self.weights == "native" and gguf is None:
            raise ValueError(f"model: weights=native needs a .gguf model, got {self.model!r}")
        if self.weights == "native" and gguf is not None:  # a tensor type not multiplied
            from tokenrelay.engine.models.gguf_weights import check_native

            check_native(gguf)
        self._check_tensor_parallel(ready)

    def _check_tensor_parallel(self, ready: Path | None) -> None:
        """``tensor_parallel_size`` against the weights and, once known, the model's heads
        (a GGUF model not converted yet is checked when the engine has its config)."""
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.tensor_parallel_size == 1:
            return
        if self.weights == "native":
            raise ValueError(
                "weights=native: tensor parallelism runs dense weights (weights auto, fp32 or "
                "bf16), not the fused decoder over quantized blocks"
            )
        if ready is not None:
            check_tensor_parallel(ModelConfig.from_pretrained(ready), self.tensor_parallel_size)

    def weights_for(self, device_type: str, backend: str = "cpu") -> str:
        """What ``auto`` means on ``device_type`` for this model: ``native`` or ``dense``.

        Native for a GGUF file on the CPU computing in fp32 with the ``cpu`` attention
        backend (the resolved one) and no tensor parallelism, unless the file holds a
        tensor type the quantized kernels do not multiply (then dense, logged).
        """
        if self.weights != "auto":
            return self.weights
        if self.tensor_parallel_size > 1:  # the ranks split dense tensors
            return "dense"
        _, gguf, _ = locate_model(self.model)
        dense_dtype = self.dtype not in (None, "float32")
        if gguf is None or device_type != "cpu" or dense_dtype or backend != "cpu":
            return "dense"
        from tokenrelay.engine.models.gguf_file import GGUFIndex
        from tokenrelay.engine.models.gguf_weights import fp32_bytes, native_unsupported

        index = GGUFIndex(gguf)  # the header, read once for both questions
        why = native_unsupported(gguf, index)
        if why is None:
            return "native"
        need, free = fp32_bytes(index), runtime.available_memory()
        if free is not None and need > free * DENSE_SHARE:
            raise ValueError(
                f"model: {why}, more than this machine can hold ({free / 2**30:.1f} GiB "
                "available): pick a smaller model, or a file the kernels multiply as it is"
            )
        log.warning(
            "weights auto: dequantizing to fp32", extra={"model": self.model, "reason": why}
        )
        return "dense"

    def default_batched_tokens(self, device_type: str) -> int:
        """The per-step token budget: the configured one, else a per-device default."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return GPU_BATCHED_TOKENS if device_type == "cuda" else CPU_BATCHED_TOKENS

    def default_prefill_while_decoding(self, device_type: str) -> int:
        """Prompt tokens a step computes beside decodes: the configured number, else 256
        on the CPU (where a step's time grows with its tokens) and the whole budget on
        CUDA (where a step of a few thousand tokens takes about as long as a decode)."""
        if self.max_prefill_while_decoding is not None:
            return self.max_prefill_while_decoding
        if device_type == "cuda":
            return self.default_batched_tokens(device_type)
        return min(CPU_PREFILL_WHILE_DECODING, self.default_batched_tokens(device_type))
