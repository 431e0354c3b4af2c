"""``tokenrelay serve``: embedded Redis + one engine worker + the gateway, one command.

Redis is an embedded redis-server unless ``--redis-url`` is given (its data
lives under ``$TOKENRELAY_HOME/redis`` unless ``--data-dir`` says otherwise).
The engine worker is a child process (the engine loop never shares the
gateway's GIL) in its own session, so a terminal's Ctrl+C reaches only this
process, which then stops the gateway, the worker and Redis in that order. The
worker also gets SIGTERM from the kernel if this process dies (and Redis gets
SIGKILL): nothing is left behind. A worker that crashes is restarted.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from core.entry import load
from core.redis.embedded import EmbeddedRedis
from core.runtime import tokenrelay_home

log = logging.getLogger("tokenrelay.serve")

GATEWAY_ENTRY = "gateway.server:main"  # run in this process (core/entry.py)

WORKER_FLAGS = (
    "log_level",
    "log_format",
    "redis_prefix",
    "model",
    "device",
    "weights",
    "dtype",
    "attention_backend",
    "block_size",
    "enforce_eager",
    "kv_cache_memory",
    "max_num_seqs",
    "max_num_batched_tokens",
    "worker_id",
    "detach_timeout",
    "stream_ttl",
    "drain_timeout",
)


def worker_command(args: argparse.Namespace, redis_url: str) -> list[str]:
    """The command line of the worker child for these ``serve`` options."""
    cmd = [sys.executable, "-m", "core.cli", "worker", "--redis-url", redis_url]
    for name in WORKER_FLAGS:
        value = getattr(args, name, None)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):  # a switch: present or not
            cmd += [flag] if value else []
        elif value is not None:
            cmd += [flag, str(value)]
    return cmd


class WorkerProcess:
    """The engine worker child: started, watched (restarted on a crash), stopped."""

    def __init__(self, cmd: list[str]) -> None:
        self.cmd = cmd
        self.proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="worker-watch", daemon=True)

    def start(self) -> None:
        self._spawn()
        self._watcher.start()

    def _spawn(self) -> None:
        env = dict(os.environ, TOKENRELAY_PARENT_PID=str(os.getpid()))
        self.proc = subprocess.Popen(self.cmd, env=env, start_new_session=True)
        log.info("engine worker started", extra={"pid": self.proc.pid})

    def _watch(self) -> None:
        restarts: list[float] = []
        while not self._stopping.is_set():
            proc = self.proc
            if proc is not None and proc.poll() is not None and not self._stopping.is_set():
                now = time.monotonic()
                restarts = [t for t in restarts if now - t < 60] + [now]
                extra = {"pid": proc.pid, "code": proc.returncode}
                log.error("engine worker exited; restarting", extra=extra)
                if len(restarts) > 5:
                    log.error("engine worker keeps crashing; not restarting it again")
                    return
                self._stopping.wait(1.0)
                if not self._stopping.is_set():
                    self._spawn()
            self._stopping.wait(0.5)

    def stop(self, timeout: float = 40.0) -> None:
        """SIGTERM (the worker drains), then SIGKILL after ``timeout`` seconds."""
        self._stopping.set()
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("engine worker did not stop in time; killing it")
            proc.kill()
            proc.wait()
        log.info("engine worker stopped", extra={"pid": proc.pid})


def main(args: argparse.Namespace) -> int:
    """Entry point of ``tokenrelay serve``."""
    redis: EmbeddedRedis | None = None
    worker: WorkerProcess | None = None
    try:
        url = args.redis_url
        if not url:
            data_dir = Path(args.data_dir) if args.data_dir else tokenrelay_home() / "redis"
            redis = EmbeddedRedis(data_dir).start()
            url = redis.url
        args.redis_url = url
        run_gateway = load(GATEWAY_ENTRY)
        worker = WorkerProcess(worker_command(args, url))
        worker.start()
        log.info("serving", extra={"url": f"http://{args.host}:{args.port}/", "redis": url})
        return run_gateway(args)
    finally:
        if worker is not None:
            worker.stop(float(getattr(args, "drain_timeout", 30.0)) + 10.0)
        if redis is not None:
            redis.stop()
