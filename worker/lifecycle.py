"""How a worker process lives and ends: its signals, its tie to ``tokenrelay serve``, its status.

Signals (``tokenrelay worker`` alone or under ``serve``): SIGTERM, SIGINT or SIGHUP drain
(take nothing new, finish what runs within ``--drain-timeout``); a second one stops at
once. SIGUSR1 is ``serve``'s own request to drain: it never escalates, because the
terminal's Ctrl+C reaches the worker as well as ``serve`` (one process group), and
``serve`` asks again once its gateway has drained.

Under ``serve`` (which sets :data:`PARENT_ENV` and :data:`STATUS_ENV`) the worker also

- dies with ``serve``: the kernel SIGKILLs it when ``serve`` ends, however it ends
  (``PR_SET_PDEATHSIG``), so a worker whose ``serve`` is gone never reaches Redis again,
  not even a Redis that a later ``serve`` started on the same socket;
- tells ``serve`` through a pipe when it is ready and, if it fails, the one-line reason,
  which ``serve`` reports when the worker keeps crashing.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable

from tokenrelay.core.runtime import die_with_parent

PARENT_ENV = "TOKENRELAY_PARENT_PID"  # the pid of the serve that started this worker
STATUS_ENV = "TOKENRELAY_STATUS_FD"  # the write end of serve's status pipe
READY = "ready"
ERROR_PREFIX = "error: "
MAX_LINE = 1000


def die_with_serve() -> None:
    """Be SIGKILLed when the ``serve`` named by :data:`PARENT_ENV` ends; exit if it is gone."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent and not die_with_parent(signal.SIGKILL, int(parent)):
        raise SystemExit(0)


class StatusPipe:
    """The worker's side of ``serve``'s status pipe (nothing to do without one)."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        if fd is not None:
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)  # not for the worker's own children

    @classmethod
    def from_env(cls) -> StatusPipe:
        value = os.environ.pop(STATUS_ENV, None)
        return cls(int(value) if value and value.isdigit() else None)

    def ready(self) -> None:
        """The engine is loaded and the loop is about to run."""
        self._write(READY)

    def failed(self, exc: BaseException) -> None:
        """Why the worker is about to exit with an error, on one line."""
        text = str(exc).strip() or type(exc).__name__
        if not isinstance(exc, ValueError):  # a user error reads best without the class
            text = f"{type(exc).__name__}: {text}"
        self._write(ERROR_PREFIX + " ".join(text.split()))

    def _write(self, line: str) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.write(self.fd, (line[:MAX_LINE] + "\n").encode(errors="replace"))


def install_signals(
    drain: Callable[[], None], stop_now: Callable[[], None], draining: Callable[[], bool]
) -> None:
    """SIGTERM/SIGINT/SIGHUP: drain, a second one stops now; SIGUSR1: drain (``serve``)."""

    def on_signal(signum: int, frame: object) -> None:
        if draining():
            stop_now()
        else:
            drain()

    def on_serve_drain(signum: int, frame: object) -> None:
        drain()  # idempotent: never turns into a stop

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGUSR1, on_serve_drain)
