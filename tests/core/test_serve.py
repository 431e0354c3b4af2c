"""``tokenrelay serve`` end to end: one command, a stream over /v1/ws, SIGTERM leaves nothing."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed

from tests.gateway.procs import Client, Proc, free_port, generate_frame, wait_ready


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


async def test_serve_runs_all_three_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--device", "cpu", "--data-dir", str(tmp_path / "r")]
    serve = Proc(args, tmp_path / "serve.log")
    addr = f"127.0.0.1:{port}"
    try:
        wait_ready(addr, serve, 300)
        kids = children(serve.pid)
        kinds = sorted("redis-server" if "redis-server" in cmdline(k) else "worker" for k in kids)
        assert kinds == ["redis-server", "worker"], [cmdline(k) for k in kids]
        c = await Client.open(addr)
        await c.send(generate_frame("Say hi.", "s1", max_tokens=6, temperature=0))
        frames = await c.recv_until(lambda f: f["type"] in ("done", "error"), 120)
        assert frames[0]["type"] == "started" and frames[-1]["type"] == "done"
        serve.signal(signal.SIGTERM)
        notice = await c.recv(30)  # the drain notice, then close code 1001
        assert notice["type"] == "notice" and notice["code"] == "shutting_down", notice
        with pytest.raises(ConnectionClosed) as info:
            await c.recv(30)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1001
        serve.proc.wait(30)
        assert serve.proc.returncode == 0, serve.log_text()[-2000:]
        deadline = time.monotonic() + 10
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [k for k in kids if alive(k)], "orphan processes left behind"
    finally:
        if serve.alive():
            os.killpg(serve.pid, signal.SIGKILL)
        serve.stop()


async def test_serve_restarts_a_killed_worker_and_its_streams_go_on(tmp_path: Path) -> None:
    """SIGKILL serve's worker with streams in flight: serve starts another, which takes
    the streams over; each ends ``length`` with gapless seqs and the uninterrupted text."""
    port = free_port()
    args = ["serve", "--port", str(port), "--device", "cpu", "--data-dir", str(tmp_path / "r")]
    serve = Proc(args, tmp_path / "serve.log")
    addr = f"127.0.0.1:{port}"
    prompts = [f"Name {n} things found in a kitchen." for n in range(2, 6)]
    params = {"max_tokens": 32, "temperature": 0, "ignore_eos": True}
    clients: list[Client] = []
    try:
        wait_ready(addr, serve, 300)
        refs = []
        for i, p in enumerate(prompts):
            c = await Client.open(addr)
            await c.send(generate_frame(p, f"ref{i}", **params))
            frames = await c.recv_until(lambda f: f["type"] in ("done", "error"), 120)
            refs.append("".join(f["text"] for f in frames if f["type"] == "token"))
            await c.close()
        for i, p in enumerate(prompts):
            c = await Client.open(addr)
            await c.send(generate_frame(p, f"k{i}", **params))
            clients.append(c)
        before = [await c.recv_until(lambda f: f.get("seq", 0) >= 4, 60) for c in clients]
        (worker,) = [k for k in children(serve.pid) if "redis-server" not in cmdline(k)]
        os.kill(worker, signal.SIGKILL)
        for c, seen, ref in zip(clients, before, refs, strict=True):
            frames = seen + await c.recv_until(lambda f: f["type"] in ("done", "error"), 180)
            done = frames[-1]
            assert done["type"] == "done" and done["finish_reason"] == "length", done
            tokens = [f for f in frames if f["type"] == "token"]
            assert [f["seq"] for f in tokens] == list(range(1, done["seq"]))
            assert "".join(f["text"] for f in tokens) == ref
        assert "engine worker exited; restarting" in serve.log_text()
    finally:
        for c in clients:
            await c.close()
        if serve.alive():
            serve.signal(signal.SIGTERM)
        serve.stop()
