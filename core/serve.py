"""``tokenrelay serve``: embedded Redis + one engine worker + the gateway, one command.

Before it starts anything, ``serve`` checks the engine options and ``--model``
(one clear line and exit status 2 when they are wrong) and binds its port (a port
in use fails the same way); "serving" is logged once the port is bound. With
``--upstream URL`` the worker is a relay to that OpenAI-compatible server
(worker/upstream/): no model is checked or loaded, only the URL.

Redis is an embedded redis-server unless ``--redis-url`` is given (its data
lives under ``$TOKENRELAY_HOME/redis`` unless ``--data-dir`` says otherwise; its
memory is bounded by ``--redis-maxmemory``, and a full one refuses writes instead
of evicting), in a session of its own: a terminal's Ctrl+C does not reach it, and
``serve`` stops it last, once the worker has written its final events. The engine
worker is a child process (the engine loop never shares the gateway's GIL) in
``serve``'s process group, so Ctrl+C reaches the gateway and the worker at once and
both drain together, for up to ``--drain-timeout``; a second Ctrl+C stops both at once.

Every child dies with ``serve``, however ``serve`` ends (SIGKILL included): the
kernel SIGKILLs it (``PR_SET_PDEATHSIG``, worker/lifecycle.py). A worker that
crashes is restarted; one that keeps crashing stops ``serve``, which exits with
status 1 and the worker's last error. A worker stopped by a signal stops ``serve``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tokenrelay.core.entry import load
from tokenrelay.core.exposure import exposure_error
from tokenrelay.core.options import env_name
from tokenrelay.core.redis.connection import redact_url
from tokenrelay.core.redis.embedded import EmbeddedRedis, parse_memory
from tokenrelay.core.runtime import tokenrelay_home

log = logging.getLogger("tokenrelay.serve")

GATEWAY_ENTRY = "tokenrelay.gateway.server:main"  # run in this process (core/entry.py)
CHECK_ENTRY = "tokenrelay.worker.main:check"  # the worker's options and model, checked here first

# the worker's side of these: worker/lifecycle.py
PARENT_ENV = "TOKENRELAY_PARENT_PID"
STATUS_ENV = "TOKENRELAY_STATUS_FD"
READY = "ready"
ERROR_PREFIX = "error: "

RESTART_DELAY = 1.0  # seconds before a crashed worker is started again
MAX_EARLY_CRASHES = 3  # in a row, before the worker ever got ready: give up
MAX_CRASHES = 5  # more than this many within CRASH_WINDOW seconds: give up
CRASH_WINDOW = 60.0
POLL = 0.1

WORKER_FLAGS = (
    "log_level",
    "log_format",
    "redis_prefix",
    "redis_cluster",
    "model",
    "model_name",
    "device",
    "weights",
    "dtype",
    "attention_backend",
    "block_size",
    "enforce_eager",
    "tensor_parallel_size",
    "kv_cache_memory",
    "kv_cache_dtype",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_prefill_while_decoding",
    "worker_id",
    "detach_timeout",
    "stream_ttl",
    "drain_timeout",
    "upstream",
    "upstream_model",
    "upstream_timeout",
    "max_inflight",
    "otlp_endpoint",
)
SECRET_FLAGS = ("--redis-url", "--upstream-api-key")  # passed in the environment, not argv


def worker_command(args: argparse.Namespace) -> list[str]:
    """The command line of the worker child for these ``serve`` options.

    The Redis URL (a password, maybe) and the upstream's key are not on it: the
    child gets them in its environment (:func:`worker_env`), which other users
    cannot read from ``ps``.
    """
    cmd = [sys.executable, "-m", "tokenrelay.core.cli", "worker"]
    for name in WORKER_FLAGS:
        value = getattr(args, name, None)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):  # a switch: present or not
            cmd += [flag] if value else []
        elif value is not None:
            cmd += [flag, str(value)]
    return cmd


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """The worker child's secrets (:data:`SECRET_FLAGS`), as its ``TOKENRELAY_*`` variables."""
    out = {}
    for flag in SECRET_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value:
            out[env_name(flag)] = str(value)
    return out


def describe_exit(code: int) -> str:
    """``exit status 2`` or ``killed by SIGSEGV``, for a ``Popen.returncode``."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit status {code}"


def stopped_on_purpose(code: int) -> bool:
    """Whether a worker's exit came from a stop request (a clean drain, a signal), not a crash."""
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
    return code in (0, 130) or -code in signals


def _read_status(fd: int) -> tuple[bool, str | None]:
    """``(ready, last error)`` from the status pipe of a worker that has exited."""
    data = b""
    with contextlib.suppress(OSError):
        while chunk := os.read(fd, 65536):
            data += chunk
    lines = data.decode(errors="replace").splitlines()
    errors = [line[len(ERROR_PREFIX) :] for line in lines if line.startswith(ERROR_PREFIX)]
    return READY in lines, (errors[-1] if errors else None)


class WorkerProcess:
    """The engine worker child: started, restarted after a crash, stopped.

    One thread does all three: the kernel's parent-death signal fires when the
    *thread* that started a child ends, so the thread that starts a worker must
    outlive it. ``on_exit`` is called (from that thread) when the worker ends for
    good without ``serve`` asking: ``serve`` should stop then. ``failure`` holds
    the reason when the worker kept crashing.
    """

    def __init__(
        self,
        cmd: list[str],
        *,
        env: dict[str, str],
        on_exit: Callable[[], None],
        timeout: float,
    ) -> None:
        self.cmd = cmd
        self.env = env  # secrets (the Redis URL ...): see worker_command
        self.on_exit = on_exit
        self.timeout = timeout  # for a drain asked by serve, before SIGKILL
        self.failure: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._now = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the worker to drain (SIGUSR1) and wait until it has exited."""
        self._stopping.set()
        if self._thread.ident is not None:  # started
            self._thread.join()

    def stop_now(self) -> None:
        """A second stop request: the worker ends its streams and exits at once."""
        self._now.set()

    def _run(self) -> None:
        crashes: list[float] = []
        early = 0
        while True:
            proc, status_fd = self._spawn()
            try:
                while proc.poll() is None and not self._stopping.wait(POLL):
                    pass
                if self._stopping.is_set():
                    self._drain(proc)
                    return
                ready, error = _read_status(status_fd)
            finally:
                os.close(status_fd)
            code = int(proc.returncode)
            reason = error or describe_exit(code)
            if stopped_on_purpose(code):
                log.info("engine worker stopped; stopping", extra={"pid": proc.pid, "code": code})
                self.on_exit()
                return
            now = time.monotonic()
            crashes = [t for t in crashes if now - t < CRASH_WINDOW] + [now]
            early = 0 if ready else early + 1
            extra = {"pid": proc.pid, "code": code, "error": reason}
            if early >= MAX_EARLY_CRASHES or len(crashes) > MAX_CRASHES:
                self.failure = reason
                log.error("engine worker keeps crashing; stopping", extra=extra)
                self.on_exit()
                return
            log.error("engine worker exited; restarting", extra=extra)
            if self._stopping.wait(RESTART_DELAY):
                return

    def _spawn(self) -> tuple[subprocess.Popen[bytes], int]:
        read_fd, write_fd = os.pipe()
        env = dict(os.environ, **{PARENT_ENV: str(os.getpid()), STATUS_ENV: str(write_fd)})
        env.update(self.env)  # not on the command line: see worker_command
        try:
            proc = subprocess.Popen(
                self.cmd, env=env, stdin=subprocess.DEVNULL, pass_fds=(write_fd,)
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        os.set_blocking(read_fd, False)  # read once the worker has exited
        self.proc = proc
        log.info("engine worker started", extra={"pid": proc.pid})
        return proc, read_fd

    def _drain(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGUSR1 (drain), SIGTERM on a second request (stop now), SIGKILL after the timeout."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + self.timeout
        hurried = False
        while proc.poll() is None:
            if self._now.is_set() and not hurried:
                hurried = True
                proc.send_signal(signal.SIGTERM)  # after a drain request: stop now
            if time.monotonic() >= deadline:
                log.warning("engine worker did not stop in time; killing it")
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(POLL)
        log.info("engine worker stopped", extra={"pid": proc.pid, "code": proc.returncode})


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``; ``ValueError`` naming the port when it cannot."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(
                f"port {port} on {host} is already in use (choose another with --port)"
            ) from None
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _stop_self() -> None:
    """Ask this process to stop as a signal would (the gateway drains, then returns)."""
    os.kill(os.getpid(), signal.SIGTERM)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``tokenrelay serve``."""
    refused = exposure_error(args)  # before anything starts, like the model check
    if refused is not None:
        raise ValueError(refused)
    try:
        maxmemory = parse_memory(args.redis_maxmemory)
    except ValueError as exc:
        raise ValueError(f"--redis-maxmemory: {exc}") from None
    load(CHECK_ENTRY)(args)  # a bad --model (--upstream): ValueError, one line, exit status 2
    sock = listen(args.host, args.port)
    redis: EmbeddedRedis | None = None
    worker: WorkerProcess | None = None
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.getsignal(sig) for sig in handled}
    for sig in (signal.SIGINT, signal.SIGTERM):  # until the gateway runs: stop starting up
        signal.signal(sig, signal.default_int_handler)
    signal.signal(signal.SIGHUP, lambda signum, frame: _stop_self())  # the terminal closed
    code = 130
    try:
        url = args.redis_url
        if not url and getattr(args, "redis_cluster", False):
            raise ValueError("--redis-cluster needs --redis-url (a node of the cluster)")
        if not url:
            data_dir = Path(args.data_dir) if args.data_dir else tokenrelay_home() / "redis"
            redis = EmbeddedRedis(data_dir, maxmemory=maxmemory).start()
            url = redis.url
        args.redis_url = url
        run_gateway = load(GATEWAY_ENTRY)
        timeout = float(getattr(args, "drain_timeout", 30.0)) + 10.0
        worker = WorkerProcess(
            worker_command(args), env=worker_env(args), on_exit=_stop_self, timeout=timeout
        )
        worker.start()
        port = sock.getsockname()[1]  # the one bound (--port 0 picks a free one)
        log.info("serving", extra={"url": f"http://{args.host}:{port}/", "redis": redact_url(url)})
        args.listen_socket = sock
        code = run_gateway(args)
    except KeyboardInterrupt:
        pass
    finally:
        if worker is not None:  # a signal now hurries the worker instead
            hurry = worker.stop_now
            for sig in handled:
                signal.signal(sig, lambda signum, frame: hurry())
            worker.stop()
        if redis is not None:
            redis.stop()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if worker is not None and worker.failure:
        log.error(f"engine worker keeps crashing: {worker.failure}")
        return 1
    return code
