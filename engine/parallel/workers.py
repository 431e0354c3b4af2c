"""Rank 0's side of a tensor-parallel engine: ranks 1..N-1 as processes it starts.

Rank 0 is the process that owns the :class:`~engine.LLMEngine` (scheduler, block
manager, tokenizer, sampler). :func:`parallel_runner` serves a ``TCPStore`` on a free
local port, starts one process per other rank (``python -m tokenrelay.engine.parallel.rank``)
with a socket pair each as its pipe, and builds rank 0's own :class:`ModelRunner` once
they said hello; every rank loads its shard at the same time. Each step rank 0 sends
the batch (:class:`~engine.runner.step.StepInput`) down every pipe, then all ranks run
the model and meet in its collectives.

Failures end in a :class:`TensorParallelError` naming the rank, never a hang: the
waits at start-up see a rank's pipe close when it dies, each step first checks that
every rank is alive, a collective with a dead peer fails at once under gloo (and after the
group's timeout otherwise), and the engine refuses every later step.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tokenrelay.engine.errors import TensorParallelError
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.parallel.group import (
    COLLECTIVE_TIMEOUT_S,
    HOST,
    Group,
    RankSpec,
    backend_for,
)
from tokenrelay.engine.parallel.layout import check_tensor_parallel
from tokenrelay.engine.runner.model_runner import ModelRunner
from tokenrelay.engine.runner.step import StepInput

log = logging.getLogger("tokenrelay.engine")

STOP_GRACE_S = 5.0  # for a rank to leave on "stop" before it is terminated
REAP_GRACE_S = 1.0  # for a rank whose collective failed to be seen dead


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """Each rank's device: the CPU for all, or CUDA devices ``index .. index + size - 1``."""
    if device.type != "cuda":
        return [device] * size
    first = device.index or 0
    count = torch.cuda.device_count()
    if first + size > count:
        raise ValueError(
            f"tensor_parallel_size: {size} ranks from {device} need {first + size} CUDA "
            f"devices, this machine has {count}"
        )
    return [torch.device("cuda", first + r) for r in range(size)]


def parallel_runner(
    size: int, device: torch.device, timeout_s: float = COLLECTIVE_TIMEOUT_S, **kwargs: Any
) -> ModelRunner:
    """Rank 0's runner of a ``size``-way tensor-parallel model, the other ranks started.

    ``kwargs`` go to every rank's :class:`ModelRunner` (dense weights only). Stop the
    ranks with :meth:`ModelRunner.close`.
    """
    if not dist.is_available() or not (
        dist.is_nccl_available() if device.type == "cuda" else dist.is_gloo_available()
    ):
        raise ValueError(
            f"tensor_parallel_size: this PyTorch build has no {backend_for(device)} backend"
        )
    check_tensor_parallel(ModelConfig.from_pretrained(kwargs["model_path"]), size)
    devices = rank_devices(device, size)
    workers = RankWorkers(size, devices, kwargs, timeout_s)
    try:
        runner = ModelRunner(device=devices[0], group=workers.group, **kwargs)
        workers.wait_for("ready")
    except BaseException as exc:
        why = workers.diagnose()
        workers.close()
        if why is not None and not isinstance(exc, TensorParallelError):
            raise TensorParallelError(f"tensor parallel start failed: {why}") from exc
        raise
    return runner


class RankWorkers:
    """The processes of ranks 1..N-1 and their pipes (rank 0's :class:`Peers`)."""

    def __init__(
        self, size: int, devices: list[torch.device], kwargs: dict[str, Any], timeout_s: float
    ) -> None:
        backend = backend_for(devices[0])
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(HOST, 0, size, is_master=True, timeout=timeout,
                              wait_for_workers=False)  # fmt: skip
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conns: list[Connection] = []
        self.broken: str | None = None  # why the group cannot step any more
        self._errors: dict[int, str] = {}  # rank -> the traceback it sent
        self._closed = False
        env = dict(os.environ)  # the child imports this very engine package
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        for rank in range(1, size):
            ours, theirs = socket.socketpair()
            with theirs:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tokenrelay.engine.parallel.rank", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    env=env,
                )
            conn = Connection(ours.detach())
            self.procs.append(proc)
            self.conns.append(conn)
            spec = RankSpec(rank, size, backend, store.port, timeout_s)
            conn.send(("start", spec, str(devices[rank]), kwargs, os.getpid()))
        try:
            self.wait_for("hello")
            self.group = Group(RankSpec(0, size, backend, store.port, timeout_s), devices[0], store)
        except BaseException:
            self.close()
            raise
        self._store = store  # served for as long as the group lives
        self.group.peers = self
        pids = [p.pid for p in self.procs]
        log.info("tensor parallel ranks started", extra={"size": size, "pids": pids})

    def wait_for(self, what: str) -> None:
        """Wait until every rank has sent ``what``; raise when one fails or dies first."""
        pending = dict(enumerate(self.conns, start=1))
        while pending:
            wait(list(pending.values()))  # a message, or EOF: the rank exited
            for rank, conn in list(pending.items()):
                kind = self._read(rank, conn)
                if kind == what:
                    del pending[rank]
                elif kind == "error" or (kind is None and self._gone(rank)):
                    self._drain()
                    self.broken = self._summary()
                    raise TensorParallelError(f"tensor parallel start failed: {self.broken}")

    def _read(self, rank: int, conn: Connection) -> str | None:
        """The kind of the next message from ``rank``, if one is there (an error is kept)."""
        try:
            if not conn.poll():
                return None
            msg = conn.recv()
        except (EOFError, OSError):
            return None
        if msg[0] == "error":
            self._errors[rank] = msg[1]
            log.error("tensor parallel rank %d failed:\n%s", rank, msg[1])
        return str(msg[0])

    def _drain(self) -> None:
        """Read every message waiting from every rank (keeping their errors)."""
        for rank, conn in enumerate(self.conns, start=1):
            while self._read(rank, conn) is not None:
                pass

    def _gone(self, rank: int) -> bool:
        """Whether ``rank``'s process has exited."""
        return self.procs[rank - 1].poll() is not None

    def _summary(self) -> str | None:
        """The ranks that died, then those that failed (often only for that), else ``None``."""
        died, failed = [], []
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            last = self._errors.get(rank, "").strip().splitlines()
            if last:
                failed.append(f"rank {rank} (pid {proc.pid}) failed: {last[-1]}")
            elif code is not None:
                how = f"exit status {code}" if code >= 0 else f"signal {-code}"
                died.append(f"rank {rank} (pid {proc.pid}) died ({how})")
        return "; ".join(died + failed) or None

    def publish(self, step: StepInput) -> None:
        """Send ``step`` to every other rank (after checking that all are alive)."""
        self.check()
        msg = ("step", step)
        for conn in self.conns:
            try:
                conn.send(msg)
            except OSError as exc:  # its reader is gone
                raise self.failure(exc) from exc

    def check(self) -> None:
        """Raise :class:`TensorParallelError` when a rank is gone or the group broke before."""
        if self.broken is None and any(p.poll() is not None for p in self.procs):
            self._drain()
            self.broken = self._summary()
        if self.broken is not None:
            raise TensorParallelError(f"tensor parallel: {self.broken}; the engine cannot step")

    def diagnose(self, grace: float = REAP_GRACE_S) -> str | None:
        """Which ranks died or failed (waiting up to ``grace`` s for one to), else ``None``."""
        if self.broken is not None:
            return self.broken
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and all(p.poll() is None for p in self.procs):
            time.sleep(0.02)  # a rank that died mid-collective: let it be reaped
        self._drain()
        self.broken = self._summary()
        return self.broken

    def failure(self, exc: BaseException) -> TensorParallelError:
        """The error for a step whose collective (or pipe) failed with ``exc``."""
        if isinstance(exc, TensorParallelError):
            return exc
        why = self.diagnose()
        if why is None:  # every rank alive: a timeout, or the group itself broke
            why = self.broken = f"a collective failed ({type(exc).__name__}: {exc})"
        return TensorParallelError(f"tensor parallel: {why}; the engine cannot step")

    def close(self) -> None:
        """Stop every rank (``stop``, then terminate) and leave the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.02)
        group = getattr(self, "group", None)
        if group is not None:
            group.close()  # a rank stuck in a collective sees the connection close
        for proc in self.procs:
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_GRACE_S)
        for conn in self.conns:
            conn.close()
