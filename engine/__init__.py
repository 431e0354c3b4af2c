"""tokenrelay's PyTorch engine: continuous batching over a paged KV cache.

``from engine import LLM, SamplingParams`` is the offline API; ``LLMEngine`` is
the step level the gateway's worker drives. Heavy modules (torch,
transformers) load on first use of the names that need them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# OpenMP threads that spin while they wait stall badly when the CPU is shared (the
# worker, the gateway and Redis on one laptop; CI): sleep instead. Read when torch
# loads, so only effective if torch was not imported before us; ACTIVE overrides.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.engine.config import EngineConfig

if TYPE_CHECKING:
    from tokenrelay.engine.llm import LLM, CompletionOutput
    from tokenrelay.engine.llm_engine import LLMEngine, RequestOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]

_LAZY = {
    "LLM": "tokenrelay.engine.llm",
    "CompletionOutput": "tokenrelay.engine.llm",
    "LLMEngine": "tokenrelay.engine.llm_engine",
    "RequestOutput": "tokenrelay.engine.llm_engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
