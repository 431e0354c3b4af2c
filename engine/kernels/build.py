"""Build plain-C kernels from ``engine/kernels/csrc`` with the system C compiler, cached.

Every compiled CPU kernel goes through :func:`build`: it compiles with ``$CC`` (else
``cc``) and :data:`FLAGS` (``-O3 -march=native -fopenmp``) into
``$TOKENRELAY_HOME/kernels``, under a name that hashes the source (with the files it
``#include "..."``s from ``csrc``), the flags, the
compiler's version and this CPU's feature flags, so a cache shared between machines
never loads code built for another CPU. The library is written beside its final name,
then renamed, so concurrent builders never see half a file. :func:`load` builds and
opens it with ``ctypes``. The kernels need no PyTorch headers: they take raw pointers
(``tensor.data_ptr()``), and every bound is checked in Python before C reads anything.

``TOKENRELAY_CPU_KERNELS=0`` (:data:`ENV_SWITCH`) turns every compiled kernel off; the
callers then keep their torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from tokenrelay.core.runtime import env_switch, tokenrelay_home

log = logging.getLogger("tokenrelay.engine")

ENV_SWITCH = "TOKENRELAY_CPU_KERNELS"
CSRC = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
COMPILE_TIMEOUT_S = 120
# What a failed build or load raises: callers catch these and keep their torch path.
BUILD_ERRORS: tuple[type[BaseException], ...] = (OSError, RuntimeError, subprocess.SubprocessError)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@cache
def _compiler_version(cc: str) -> str:
    done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    return done.stdout


_target_locks: dict[Path, threading.Lock] = {}
_target_locks_guard = threading.Lock()


def _target_lock(target: Path) -> threading.Lock:
    """One lock per library: a second builder in this process waits for the first."""
    with _target_locks_guard:
        return _target_locks.setdefault(target, threading.Lock())


def _sources(source: Path, seen: tuple[Path, ...] = ()) -> list[bytes]:
    """``source``'s bytes, then those of each local ``#include "x"`` it names, depth first."""
    code = source.read_bytes()
    parts = [code]
    for name in re.findall(rb'^\s*#\s*include\s+"([^"]+)"', code, re.M):
        dep = source.parent / name.decode()
        if dep not in seen and dep.is_file():
            parts += _sources(dep, (*seen, source))
    return parts


def build(source: Path, cache_dir: Path | None = None, extra_flags: Sequence[str] = ()) -> Path:
    """Compile ``source`` into a shared library (or reuse the cached one); returns its path.

    ``extra_flags`` go after :data:`FLAGS` (and into the cache key): tests use them to
    build a kernel's narrower paths, e.g. ``-mno-avx512f``. Raises ``RuntimeError`` with
    the compiler's message when there is no compiler or the compilation fails.
    """
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise RuntimeError(f"no C compiler found ({os.environ.get('CC', 'cc')!r} not on PATH)")
    key = hashlib.sha256()
    flags = (*FLAGS, *extra_flags)
    for part in (*_sources(source), " ".join(flags).encode(), _compiler_version(cc).encode()):
        key.update(part)
    key.update((platform.machine() + _cpu_flags()).encode())
    out_dir = cache_dir or tokenrelay_home() / "kernels"
    target = out_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    with _target_lock(target):
        if not target.exists():  # else built meanwhile (prebuild())
            _compile(cc, flags, source, out_dir, target)
    return target


def _compile(cc: str, flags: Sequence[str], source: Path, out_dir: Path, target: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    log.info("compiling CPU kernel", extra={"source": source.name, "target": str(target)})
    # Build beside the target, then rename: concurrent builders never see half a file.
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{source.stem}-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *flags, "-o", tmp, str(source)],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip()[-2000:]
            raise RuntimeError(f"{Path(cc).name} failed on {source.name}: {tail}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info(
        "CPU kernel compiled",
        extra={"source": source.name, "seconds": round(time.monotonic() - started, 2)},
    )


def prebuild(sources: Sequence[Path], cache_dir: Path | None = None) -> list[threading.Thread]:
    """Start compiling ``sources`` side by side, each in a thread of its own.

    A first start compiles every kernel it will load; started before the weights are
    read, the compilers run beside that and beside each other. Errors are left for the
    :func:`load` that needs the library (it waits for a build in progress, then raises
    or reuses the result). Returns the threads (tests join them).
    """
    if not env_switch(ENV_SWITCH):
        return []
    threads = [
        threading.Thread(target=_build_quietly, args=(src, cache_dir), name=f"build-{src.stem}")
        for src in sources
    ]
    for thread in threads:
        thread.start()
    return threads


def _build_quietly(source: Path, cache_dir: Path | None) -> None:
    try:
        build(source, cache_dir)
    except BUILD_ERRORS as exc:
        log.debug("prebuild failed", extra={"source": source.name, "error": str(exc)[-300:]})


def load(
    source: Path, cache_dir: Path | None = None, extra_flags: Sequence[str] = ()
) -> ctypes.CDLL:
    """:func:`build` ``source`` (or reuse the cache) and open the library with ``ctypes``."""
    return ctypes.CDLL(str(build(source, cache_dir, extra_flags)))
