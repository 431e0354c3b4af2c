"""What every benchmark in bench/ reports the same way: the machine, its load, its saved table."""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"  # gitignored: a run's saved tables and JSON


def say(*parts: object) -> None:
    """Print a progress line now (flushed: the output may be a pipe or a log)."""
    print(*parts, flush=True)


def machine() -> str:
    """``"<CPU model>, <n> cores"`` (the cores this process may use)."""
    name = platform.processor() or "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} cores"


def load_average() -> str:
    """The 1, 5 and 15-minute load averages, or ``n/a``."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def result_path(name: str) -> Path:
    """``bench/results/<name>``: where a bench's ``--out`` saves when given no path."""
    return RESULTS / name


def write_result(path: Path, text: str) -> None:
    """Write a bench's report (its table, or JSON) to ``path`` and say where it went."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")
    print(f"wrote {path}")


@contextlib.contextmanager
def load_generator_gc() -> Iterator[None]:
    """No cyclic-GC pauses in a load generator while it measures.

    A full collection in a process holding 1,000 client sockets pauses all of them,
    and each one showed up as a latency spike of the system under test. Within the
    block, what exists is frozen out of the collector and collection is off
    (reference counting still frees memory).
    Only for load generators: servers under test keep their own GC.
    """
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()
