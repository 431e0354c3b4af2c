"""Suite-wide fixtures: offline Hugging Face, a real redis-server per session, a real
Redis Cluster (three redis-server >= 7 masters; skipped where there is none), and the
shared process fixtures of ``pytest_plugins``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see engine/__init__.py

from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.redis.local_cluster import LocalCluster, cluster_unsupported_reason

# Process fixtures that a folder's tests and the end-to-end suites (tests/e2e/) both use,
# declared once for the whole suite so that a run starts each of them once: a fixture
# imported into a second conftest would be a second fixture, with servers of its own.
pytest_plugins = ["tests.gateway.stack", "tests.worker.upstream.servers"]


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


def _cluster(folder: Path) -> Iterator[LocalCluster]:
    reason = cluster_unsupported_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = LocalCluster(folder).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A 3-master Redis Cluster for the whole session (skipped without redis-server >= 7).

    Shared: tests use keys of their own and never kill a node (``fresh_redis_cluster``).
    """
    yield from _cluster(tmp_path_factory.mktemp("redis-cluster"))


@pytest.fixture
def fresh_redis_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A 3-master Redis Cluster of the test's own, for one that kills or restarts masters."""
    yield from _cluster(tmp_path / "redis-cluster")
