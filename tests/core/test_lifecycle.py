"""How ``tokenrelay serve`` and its children start and end (issue 19).

Ctrl+C is a SIGINT to serve's whole process group (``Proc`` starts serve in a
session of its own, so its group id is its pid). The time bounds are the ones the
issue names: idle Ctrl+C ends everything within 3 s; a SIGKILLed serve leaves
nothing behind within a few seconds.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed

from tests.core.test_serve import alive, children, cmdline
from tests.gateway.procs import Client, Proc, free_port, generate_frame, wait_ready
from tokenrelay.core.redis.embedded import EmbeddedRedis


def start_serve(tmp_path: Path, *extra: str) -> tuple[Proc, str, dict[str, int]]:
    """A ready ``serve`` on a free port, and its children's pids by kind."""
    port = free_port()
    args = ["serve", "--port", str(port), "--device", "cpu", "--data-dir", str(tmp_path / "r")]
    serve = Proc([*args, *extra], tmp_path / "serve.log")
    addr = f"127.0.0.1:{port}"
    wait_ready(addr, serve, 300)
    kids = {("redis" if "redis-server" in cmdline(k) else "worker"): k for k in children(serve.pid)}
    assert sorted(kids) == ["redis", "worker"], kids
    return serve, addr, kids


def wait_all_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


def kill_leftovers(serve: Proc, kids: dict[str, int]) -> None:
    for pid in [serve.pid, *kids.values()]:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    serve.stop()


def test_idle_ctrl_c_ends_everything_within_3s(tmp_path: Path) -> None:
    serve, _, kids = start_serve(tmp_path)
    try:
        started = time.monotonic()
        os.killpg(serve.pid, signal.SIGINT)
        left = wait_all_gone([serve.pid, *kids.values()], 3.0)
        took = time.monotonic() - started
        assert not left, f"still running after {took:.1f}s: {left}\n{serve.log_text()[-3000:]}"
        assert serve.proc.wait(1) == 0, serve.log_text()[-3000:]
    finally:
        kill_leftovers(serve, kids)


async def test_ctrl_c_lets_a_running_stream_finish(tmp_path: Path) -> None:
    serve, addr, kids = start_serve(tmp_path)
    try:
        c = await Client.open(addr)
        params = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}
        await c.send(generate_frame("Count to fifty.", "r1", **params))
        await c.recv_until(lambda f: f["type"] == "token", 120)
        os.killpg(serve.pid, signal.SIGINT)  # Ctrl+C while the stream runs
        frames = await c.recv_until(lambda f: f["type"] in ("done", "error"), 60)
        assert frames[-1]["type"] == "done", frames[-3:]
        # written through Redis after the Ctrl+C: Redis outlived the worker's drain
        assert frames[-1]["finish_reason"] == "length", frames[-1]
        with pytest.raises(ConnectionClosed):
            await c.recv(30)
        assert serve.proc.wait(30) == 0, serve.log_text()[-3000:]
        assert not wait_all_gone(list(kids.values()), 5.0)
    finally:
        kill_leftovers(serve, kids)


async def test_second_ctrl_c_stops_a_drain_at_once(tmp_path: Path) -> None:
    serve, addr, kids = start_serve(tmp_path, "--drain-timeout", "120")
    try:
        c = await Client.open(addr)
        params = {"max_tokens": 4000, "temperature": 0, "ignore_eos": True}
        await c.send(generate_frame("Tell a very long story.", "r1", **params))
        await c.recv_until(lambda f: f["type"] == "token", 120)
        os.killpg(serve.pid, signal.SIGINT)
        await c.recv_until(lambda f: f["type"] == "notice", 30)
        later = time.monotonic() + 1.0  # tokens still flow a second after the Ctrl+C
        frames = await c.recv_until(lambda f: f["type"] != "token" or time.monotonic() > later)
        assert frames[-1]["type"] == "token", frames[-1]
        assert serve.alive(), "the first Ctrl+C should drain, not stop"
        started = time.monotonic()
        os.killpg(serve.pid, signal.SIGINT)
        left = wait_all_gone([serve.pid, *kids.values()], 10.0)
        took = time.monotonic() - started
        assert not left, f"still running {took:.1f}s after the second Ctrl+C: {left}"
    finally:
        kill_leftovers(serve, kids)


async def test_sigkill_of_serve_leaves_no_worker_and_no_redis(tmp_path: Path) -> None:
    serve, addr, kids = start_serve(tmp_path)
    later: EmbeddedRedis | None = None
    try:
        c = await Client.open(addr)
        params = {"max_tokens": 4000, "temperature": 0, "ignore_eos": True}
        await c.send(generate_frame("Tell a very long story.", "r1", **params))
        await c.recv_until(lambda f: f["type"] == "token", 120)
        os.kill(serve.pid, signal.SIGKILL)  # serve alone: its children get no signal from us
        serve.proc.wait(10)
        # a later serve's Redis on the same socket: the orphaned worker must never reach it
        later = EmbeddedRedis(tmp_path / "r").start()
        left = wait_all_gone(list(kids.values()), 5.0)
        assert not left, {k: p for k, p in kids.items() if p in left}
        client = later.client()
        assert len(client.client_list()) == 1, client.client_list()  # only this test's
        client.close()
    finally:
        if later is not None:
            later.stop()
        kill_leftovers(serve, kids)


def run_serve(tmp_path: Path, *extra: str, timeout: float) -> tuple[int, str]:
    """Run ``serve`` expected to fail on its own; its exit status and its output."""
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "r"), *extra]
    serve = Proc(args, tmp_path / "serve.log")
    code = serve.wait_stopped(timeout)
    assert code != -signal.SIGKILL, f"serve did not exit by itself:\n{serve.log_text()[-3000:]}"
    return code, serve.log_text()


def test_bad_model_fails_before_anything_starts(tmp_path: Path) -> None:
    code, out = run_serve(tmp_path, "--model", str(tmp_path / "no-such-model"), timeout=60)
    assert code == 2, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and "no-such-model" in lines[0], out


def test_port_in_use_fails_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        serve = Proc(
            ["serve", "--port", str(port), "--device", "cpu", "--data-dir", str(tmp_path / "r")],
            tmp_path / "serve.log",
        )
        code = serve.wait_stopped(60)
    out = serve.log_text()
    assert code not in (0, -signal.SIGKILL), out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and str(port) in lines[0] and "in use" in lines[0], out
    assert not (tmp_path / "r").exists(), "Redis was started"


def test_a_worker_that_keeps_crashing_stops_serve(tmp_path: Path) -> None:
    # cuda:99 passes the option check and fails in the engine, on every machine
    code, out = run_serve(tmp_path, "--device", "cuda:99", timeout=240)
    assert code == 1, out[-3000:]
    assert out.count("engine worker started") >= 2, "it should have been restarted"
    last = out.strip().splitlines()[-1]  # the worker's own last error, not just a status
    assert "engine worker keeps crashing: " in last and "cuda" in last.lower(), out[-3000:]
    assert "serving" in out
