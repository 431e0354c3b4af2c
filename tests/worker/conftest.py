"""The worker tests drive the real engine: the engine suite's session fixtures."""

from tests.engine.conftest import llm_engine, model_path

__all__ = ["llm_engine", "model_path"]
