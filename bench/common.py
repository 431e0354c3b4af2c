"""What every benchmark in bench/ reports the same way: the machine, its load, the docs section."""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = ROOT / "docs" / "benchmarks.md"


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


def write_docs_section(section: str, text: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace the ``section`` heading's part of docs/benchmarks.md with ``text`` (or append it)."""
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    start = old.find(section + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + len(section))
        rest = old[end + 1 :] if end >= 0 else ""
        new = old[:start] + text.rstrip("\n") + ("\n\n" + rest if rest else "\n")
    path.write_text(new)
    print(f"updated {path}")


@contextlib.contextmanager
def load_generator_gc() -> Iterator[None]:
    """No cyclic-GC pauses in a load generator while it measures.

    A full collection in a process holding 1,000 client sockets took 140-170 ms
    on the 2-core bench machine, and each one showed up as a latency spike of the
    system under test. Within the block, what exists is frozen out of the
    collector and collection is off (reference counting still frees memory).
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
