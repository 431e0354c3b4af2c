"""Facts about the running installation: version, cache folder, asset folders, switches.

One place for what every process asks of its environment: the package version
(``tokenrelay --version``, the ``Server`` header, the page's asset tag), the
cache root ``$TOKENRELAY_HOME``, where the browser assets live, feature
switches read from the environment, the memory available, and tying a child process's life to its
parent's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from importlib import metadata
from pathlib import Path

PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when its parent dies

# web/ and static/ sit beside the packages in a checkout; a wheel installs them
# as data files under <prefix>/share/tokenrelay/ (pyproject.toml).
_SOURCE_ROOT = Path(__file__).resolve().parent.parent
_DATA_ROOT = Path(sys.prefix) / "share" / "tokenrelay"


def version() -> str:
    """The installed package's version, ``0+unknown`` when run from a bare checkout."""
    try:
        return metadata.version("tokenrelay")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def tokenrelay_home() -> Path:
    """The cache root: ``$TOKENRELAY_HOME`` or ``~/.cache/tokenrelay``."""
    env = os.environ.get("TOKENRELAY_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tokenrelay"


def asset_dir(name: str) -> Path:
    """The folder ``web`` or ``static``: the checkout's own, else the installed data files."""
    for root in (_SOURCE_ROOT, _DATA_ROOT):
        if (root / name).is_dir():
            return root / name
    raise FileNotFoundError(f"the {name}/ folder is neither at {_SOURCE_ROOT} nor {_DATA_ROOT}")


def available_memory() -> int | None:
    """Bytes of memory available now (Linux ``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def env_switch(name: str) -> bool:
    """A feature switch read from the environment: on unless set to 0, false, no or off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def die_with_parent(sig: int = signal.SIGTERM, parent_pid: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux).

    ``parent_pid`` is the parent expected: when it is given and this process's
    parent is already someone else (it died before the request took effect),
    returns False and the caller should exit. Elsewhere than Linux it does
    nothing and returns True.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    return parent_pid is None or os.getppid() == parent_pid
