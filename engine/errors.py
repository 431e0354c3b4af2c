"""The engine's exceptions, in one place (what callers of the engine catch)."""

from __future__ import annotations

__all__ = ["ModelNotFoundError", "TensorParallelError"]


class ModelNotFoundError(ValueError):
    """A model name that resolves to nothing (unknown path, missing package)."""


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine died or failed: the engine cannot step any more."""
