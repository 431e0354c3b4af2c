"""The two servers of bench/vs_llamacpp.py, started one at a time on the same GGUF file:
``tokenrelay serve`` and ``llama-server``, each in its own process group, with their sizing
(llama-server's slots and context, tokenrelay's KV pool), readiness and stopping; and their
memory: VmRSS summed over a server's process tree (read from /proc), sampled in a thread
while it runs."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench import model_1b
from bench.common import ROOT, say

OURS, PEER = "tokenrelay", "llama.cpp"
BLOCK_SIZE = 16  # tokenrelay's KV block (the CPU backend's default), when the pool is matched
# tokenrelay's KV element on CPU by --weights: float16 under the fused decoder (auto and
# native for a GGUF; --kv-cache-dtype auto), the compute dtype's otherwise; llama.cpp's is f16
KV_ELEM = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2)}
KV_ELEM_FUSED = ("float16", 2)


@dataclass
class ServerConfig:
    """One phase's sizing: llama-server's ``-np`` slots and ``-c`` context (all slots), and
    tokenrelay's KV pool (``kv_tokens`` None: the engine's default pool)."""

    slots: int
    ctx: int
    kv_tokens: int | None
    block_size: int = BLOCK_SIZE
    kv_elem: tuple[str, int] = KV_ELEM_FUSED  # the pool's dtype and its bytes

    def kv_gib(self, shape: dict[str, int]) -> float:
        """--kv-cache-memory that holds exactly kv_tokens // block_size blocks."""
        assert self.kv_tokens is not None
        per_block = 2 * shape["layers"] * self.block_size * shape["kv_heads"] * shape["head_dim"]
        blocks = self.kv_tokens // self.block_size
        return (blocks + 0.5) * per_block * self.kv_elem[1] / 2**30

    def describe_ours(self, shape: dict[str, int]) -> str:
        if self.kv_tokens is None:
            return "KV pool: the engine's default (16384 tokens on CPU)"
        blocks = self.kv_tokens // self.block_size
        return (
            f"KV pool {blocks} blocks x {self.block_size} = {blocks * self.block_size} tokens "
            f"(--kv-cache-memory {self.kv_gib(shape):.4f} GiB at {self.kv_elem[0]})"
        )

    def describe_peer(self) -> str:
        return f"-np {self.slots} -c {self.ctx} ({self.ctx // self.slots} tokens per slot)"


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def level_config(args: argparse.Namespace) -> ServerConfig:
    per_slot = max(512, args.max_tokens + 256)
    ctx = per_slot * args.llama_parallel
    return ServerConfig(args.llama_parallel, ctx, ctx if args.match_kv else None,
                        kv_elem=KV_ELEM.get(args.weights, KV_ELEM_FUSED))  # fmt: skip


def long_config(args: argparse.Namespace) -> ServerConfig:
    """One slot whose context admits the longest prompt (with margin) and its output."""
    ctx = round_up(int(max(args.long_prompts) * 1.25) + args.long_max_tokens + 512, 1024)
    return ServerConfig(1, ctx, ctx, kv_elem=KV_ELEM.get(args.weights, KV_ELEM_FUSED))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A server in its own process group, logging to a temp folder; stopped with the group."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        ready_path: str,
        port: int,
        env: dict[str, str] | None = None,
    ):
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.ready_path = ready_path
        self.dir = Path(tempfile.mkdtemp(prefix=f"vs-llamacpp-{name.replace('.', '')}-"))
        self.log_path = self.dir / "server.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115
        say("starting", " ".join(cmd))
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        self.memory = RssSampler(self.proc.pid)

    def tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}"
                )
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} was not ready within {timeout:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        self.memory.stop()
        if self.proc.poll() is None:  # the leader stops its children itself, then the group
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # whatever of the group is left
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_ours(args: argparse.Namespace, gguf: Path, config: ServerConfig) -> Proc:
    """``tokenrelay serve`` on the CPU, this GGUF file, Redis data in a temp dir; logging at
    ``args.log_level`` if set, else warning."""
    port = free_port()
    exe = Path(sys.executable).with_name("tokenrelay")
    base = [str(exe)] if exe.is_file() else [sys.executable, "-m", "tokenrelay.core.cli"]
    data = Path(tempfile.mkdtemp(prefix="vs-llamacpp-redis-"))
    model = ["--model", "default"] if args.model == "default" else [
        "--model", str(gguf), "--model-name", "default"]  # fmt: skip
    cmd = [*base, "serve", "--port", str(port), "--host", "127.0.0.1", *model,
           "--device", "cpu", "--weights", args.weights, "--data-dir", str(data),
           "--log-level", getattr(args, "log_level", "warning")]  # fmt: skip
    if config.kv_tokens is not None:
        kv_gib = config.kv_gib(model_1b.gguf_kv_shape(gguf))
        cmd += ["--block-size", str(config.block_size), "--kv-cache-memory", f"{kv_gib:.6f}"]
    proc = Proc(OURS, cmd, "/readyz", port)
    proc.extra_dir = data  # type: ignore[attr-defined]
    return proc


def start_peer(
    args: argparse.Namespace, binary: Path, gguf: Path, config: ServerConfig, *extra: str
) -> Proc:
    """``llama-server`` on this GGUF file, sized by ``config``; ``extra``: more options."""
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "-t", str(args.threads),
           "-np", str(config.slots), "-c", str(config.ctx),
           "--port", str(port), "--host", "127.0.0.1", *extra]  # fmt: skip
    env = dict(os.environ)  # a shared build's libraries lie next to the binary
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        x for x in (str(binary.parent), env.get("LD_LIBRARY_PATH")) if x
    )
    return Proc(PEER, cmd, "/health", port, env=env)


@contextlib.contextmanager
def running(proc_factory, timeout: float) -> Iterator[Proc]:
    proc = None
    try:
        proc = proc_factory()
        took = proc.wait_ready(timeout)
        say(f"{proc.name} ready in {took:.1f} s at {proc.url}")
        yield proc
    finally:
        if proc is not None:
            proc.stop()
            extra = getattr(proc, "extra_dir", None)
            if extra is not None:
                shutil.rmtree(extra, ignore_errors=True)
            say(f"{proc.name} stopped")


# --- memory --------------------------------------------------------------------------


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (a tokenrelay serve: gateway, worker, redis-server)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def process_names(pids: list[int]) -> str:
    names = []
    for pid in pids:
        with contextlib.suppress(OSError):
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
    return ", ".join(sorted(names))


def tree_rss(root: int) -> int:
    """VmRSS summed over ``root``'s process tree, in bytes (0 once it is gone)."""
    total = 0
    for pid in process_tree(root):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total


class RssSampler:
    """Samples a server's summed RSS every ``interval`` seconds in a thread: the peak."""

    def __init__(self, root: int, interval: float = 0.25):
        self.root = root
        self.peak = 0
        self.interval = interval
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True, name="rss-sampler")
        self.thread.start()

    def sample(self) -> int:
        rss = tree_rss(self.root)
        self.peak = max(self.peak, rss)
        return rss

    def run(self) -> None:
        while not self.done.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self.done.set()
        self.thread.join(5)


@dataclass
class Memory:
    after_warmup: int = 0  # bytes, summed over the server's processes
    peak: int = 0  # the highest sample while the levels ran (from the warm-up on)
    load_peak: int = 0  # the highest sample from the start to the end of the warm-up
    processes: int = 0
    names: str = ""  # their command names


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
