"""The embedded Redis manager: a real redis-server that dies with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.root import ROOT
from tokenrelay.core.options import REDIS_MAXMEMORY
from tokenrelay.core.redis.embedded import EmbeddedRedis, find_redis_server, parse_memory


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); look at its state
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def test_finds_a_binary() -> None:
    assert os.access(find_redis_server(), os.X_OK)


def test_start_roundtrip_stop(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "r1").start()
    try:
        assert server.proc is not None
        pid = server.proc.pid
        client = server.client()
        first = client.xadd("s", {"seq": 1, "text": "héllo"}, id="1-1")
        client.xadd("s", {"seq": 2, "text": "wörld"}, id="2-1")
        entries = client.xrange("s")
        assert [e[0] for e in entries] == [first, b"2-1"]
        assert entries[0][1][b"text"].decode() == "héllo"
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert client.config_get("appendfsync")["appendfsync"] == "everysec"
        client.close()
    finally:
        server.stop()
    assert not _alive(pid)


def test_restart_keeps_data_through_aof(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "r").start()
    try:
        c = server.client()
        c.xadd("s", {"k": "v"}, id="7-1")
        c.close()
        server.stop()
        server.start()
        c = server.client()
        assert c.xrange("s")[0][0] == b"7-1"
        c.close()
    finally:
        server.cleanup()


def test_two_managers_side_by_side(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "a") as a, EmbeddedRedis(tmp_path / "b", use_tcp=True) as b:
        assert a.url != b.url
        ca, cb = a.client(), b.client()
        ca.set("k", "a")
        cb.set("k", "b")
        assert ca.get("k") == b"a"
        assert cb.get("k") == b"b"
        ca.close()
        cb.close()


def test_long_data_dir_path_still_works(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 60) / ("y" * 60)
    with EmbeddedRedis(deep) as server:
        c = server.client()
        assert c.ping()
        c.close()


def test_child_dies_when_parent_is_sigkilled(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from tokenrelay.core.redis.embedded import EmbeddedRedis
        server = EmbeddedRedis({str(tmp_path / "orphan")!r}).start()
        print(server.proc.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert _alive(child_pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child_pid), "redis-server outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_bad_startup_timeout_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="startup_timeout"):
        EmbeddedRedis(tmp_path, startup_timeout=0)


def test_session_fixture_works(redis_server: EmbeddedRedis) -> None:
    c = redis_server.client()
    assert c.ping()
    c.close()


def test_one_embedded_redis_per_data_folder(tmp_path: Path) -> None:
    """Two serves with one TOKENRELAY_HOME: the second fails clearly, not on a shared socket."""
    first = EmbeddedRedis(tmp_path).start()
    try:
        with pytest.raises(ValueError, match="in use by another tokenrelay serve"):
            EmbeddedRedis(tmp_path).start()
        first.kill()  # a restart of the same manager keeps the folder (fault tests do this)
        first.start()
        assert first.client().ping()
    finally:
        first.stop()
    second = EmbeddedRedis(tmp_path).start()  # stopped: free again
    second.stop()


def test_serve_refuses_a_data_folder_in_use(tmp_path: Path) -> None:
    """The same check from `tokenrelay serve`: one line, exit status 2."""
    from tests.gateway.procs import free_port

    held = EmbeddedRedis(tmp_path).start()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tokenrelay.core.cli", "serve", "--port", str(free_port()),
             "--data-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "in use by another tokenrelay serve" in proc.stderr
    finally:
        held.stop()


def test_memory_is_bounded_and_never_evicted(tmp_path: Path) -> None:
    """maxmemory (the flag's default, or as given) with noeviction: a full Redis drops nothing."""
    with EmbeddedRedis(tmp_path / "default") as server:
        config = server.client().config_get("maxmemory*")
        assert config["maxmemory"] == str(parse_memory(REDIS_MAXMEMORY)) == str(1024**3)
        assert config["maxmemory-policy"] == "noeviction"
    with EmbeddedRedis(tmp_path / "small", maxmemory="64mb") as server:
        config = server.client().config_get("maxmemory*")
        assert config["maxmemory"] == str(64 * 1024**2)
        assert config["maxmemory-policy"] == "noeviction"


@pytest.mark.parametrize(
    ("text", "size"),
    [("1073741824", 1024**3), ("512mb", 512 * 1024**2), ("2GB", 2 * 1024**3),
     ("1g", 10**9), ("5000k", 5 * 10**6), (" 16Mb ", 16 * 1024**2), ("0", 0)],
)  # fmt: skip
def test_memory_sizes_in_redis_syntax(text: str, size: int) -> None:
    assert parse_memory(text) == size


@pytest.mark.parametrize("text", ["lots", "1.5gb", "-1", "12tb", "mb", "1 gb", "100kb", ""])
def test_a_bad_memory_size_is_a_clear_error(tmp_path: Path, text: str) -> None:
    with pytest.raises(ValueError, match=r"memory size|too small"):
        parse_memory(text)
    with pytest.raises(ValueError, match=r"memory size|too small"):
        EmbeddedRedis(tmp_path, maxmemory=text)  # before anything starts


@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_refuses_a_bad_redis_maxmemory(tmp_path: Path, how: str) -> None:
    """One line and exit status 2, before the model check, the port or Redis."""
    args = ["serve", "--port", "1", "--data-dir", str(tmp_path / "r")]
    env = dict(os.environ)
    if how == "flag":
        args += ["--redis-maxmemory", "lots"]
    else:
        env["TOKENRELAY_REDIS_MAXMEMORY"] = "lots"
    proc = subprocess.run(
        [sys.executable, "-m", "tokenrelay.core.cli", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr
    assert err.count("\n") == 1 and "--redis-maxmemory" in err and "'lots'" in err, err
    assert not (tmp_path / "r").exists(), "Redis was started"
