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
