"""Suite-wide fixtures: offline Hugging Face, a real redis-server per session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see engine/__init__

from core.redis.embedded import EmbeddedRedis


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A real redis-server for the whole session (the same manager `serve` uses)."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.cleanup()
