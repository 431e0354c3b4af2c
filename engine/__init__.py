"""tokenrelay's PyTorch engine: continuous batching over a paged KV cache.

``from engine import LLM, SamplingParams`` is the offline API; ``LLMEngine`` is
the step level the gateway's worker drives. Heavy modules (torch,
transformers) load on first use of the names that need them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.params import SamplingParams

if TYPE_CHECKING:
    from engine.llm import LLM, CompletionOutput
    from engine.llm_engine import LLMEngine, RequestOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]

_LAZY = {
    "LLM": "engine.llm",
    "CompletionOutput": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "RequestOutput": "engine.llm_engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
