"""Getting llama-server, and llama-quantize beside it, for bench/vs_llamacpp.py.

Taken from ``--llama-server``, ``$LLAMA_SERVER`` or the cache
``~/.cache/tokenrelay-bench/llama.cpp/bin/``; else both are built there from the llama.cpp
vendored in the llama-cpp-python sdist on PyPI (cmake + a C++ compiler, installed with
apt-get when running as root): with the CMake options that llama.cpp's CMake files know,
and, where the CPU lists AMX that faults (a VM without AMX state), without GGML_NATIVE and
with the CPU's other instruction sets named one by one.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from bench.common import machine, say

CACHE = Path.home() / ".cache" / "tokenrelay-bench" / "llama.cpp"
CACHED_BINARY = CACHE / "bin" / "llama-server"
CACHED_QUANTIZE = CACHE / "bin" / "llama-quantize"
TARGETS = ("llama-server", "llama-quantize")  # built together, cached side by side
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


def find_quantize(args: argparse.Namespace) -> Path:
    """The cached llama-quantize (beside llama-server), built with it when missing."""
    if not (CACHED_QUANTIZE.is_file() and os.access(CACHED_QUANTIZE, os.X_OK)):
        say(f"no {CACHED_QUANTIZE}: building llama-server and llama-quantize")
        build_llama_server(args.build_jobs)
    return CACHED_QUANTIZE


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
