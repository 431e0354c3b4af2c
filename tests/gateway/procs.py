"""Real processes for end-to-end tests: gateways, engine workers, WebSocket clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect

from tests.root import ROOT


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A ``tokenrelay`` subcommand running as a child process, logging to a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        full_env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENRELAY_LOG_FORMAT="json", **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenrelay.core.cli", *args],
            cwd=ROOT,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 15.0) -> int:
        self.terminate()
        return self.wait_stopped(timeout)

    def terminate(self) -> None:
        """SIGTERM once (a second one would make the gateway skip its drain)."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout: float) -> int:
        """Wait for the exit; SIGKILL after ``timeout`` seconds."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)


def stop_all(procs: list[Proc], timeout: float = 15.0) -> None:
    """SIGTERM every process at once, then wait for each: they drain in parallel."""
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.wait_stopped(max(0.1, deadline - time.monotonic()))


def start_worker(
    redis_url: str, prefix: str, log_dir: Path, *extra: str, env: dict[str, str] | None = None
) -> Proc:
    args = ["worker", "--redis-url", redis_url, "--redis-prefix", prefix, "--device", "cpu"]
    return Proc([*args, *extra], log_dir / f"worker-{time.monotonic_ns()}.log", env)


def start_gateway(redis_url: str, prefix: str, log_dir: Path, *extra: str) -> tuple[Proc, str]:
    port = free_port()
    args = ["gateway", "--redis-url", redis_url, "--redis-prefix", prefix, "--port", str(port)]
    proc = Proc([*args, *extra], log_dir / f"gateway-{port}.log")
    return proc, f"127.0.0.1:{port}"


def wait_ready(addr: str, proc: Proc, timeout: float = 120.0, *, need_worker: bool = True) -> None:
    """Poll ``/readyz`` (or ``/healthz``) until it answers 200."""
    path = "/readyz" if need_worker else "/healthz"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"process exited early:\n{proc.log_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://{addr}{path}", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{addr}{path} not ready in {timeout}s:\n{proc.log_text()[-3000:]}")


class FrameReader:
    """``recv_until`` for a protocol v1 client that has ``recv(timeout)``."""

    async def recv(self, timeout: float = 30.0) -> dict[str, Any]:
        raise NotImplementedError

    async def recv_until(self, pred: Any, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Frames up to and including the first one for which ``pred`` is true."""
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while True:
            frame = await self.recv(max(0.1, deadline - time.monotonic()))
            out.append(frame)
            if pred(frame):
                return out


class Client(FrameReader):
    """A protocol v1 client over a real WebSocket."""

    def __init__(self, ws: ClientConnection, hello: dict[str, Any]) -> None:
        self.ws = ws
        self.hello = hello

    @classmethod
    async def open(cls, addr: str, **kw: Any) -> Client:
        ws = await connect(f"ws://{addr}/v1/ws", open_timeout=10, max_size=None, **kw)
        hello = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert hello["type"] == "hello", hello
        return cls(ws, hello)

    async def send(self, frame: dict[str, Any] | str) -> None:
        await self.ws.send(frame if isinstance(frame, str) else json.dumps(frame))

    async def recv(self, timeout: float = 30.0) -> dict[str, Any]:
        return dict(json.loads(await asyncio.wait_for(self.ws.recv(), timeout)))

    async def close(self) -> None:
        await self.ws.close()

    def cut(self) -> None:
        """Drop the TCP connection abruptly (no close frame)."""
        self.ws.transport.abort()


def generate_frame(prompt: str, request_id: str, **params: Any) -> dict[str, Any]:
    return {
        "type": "generate",
        "request_id": request_id,
        "messages": [{"role": "user", "content": prompt}],
        "params": params,
    }
