"""A tensor-parallel worker rank (1..N-1): its shard of the model, driven by rank 0.

:func:`rank_main` runs in a process rank 0 spawned (engine/parallel/workers.py). It
says ``hello``, joins the process group, builds its :class:`ModelRunner` (this rank's
weights and KV heads; the pool's size agreed with the others), says ``ready``, then
runs every step rank 0 sends on its pipe, taking part in the step's collectives. It
ends on ``stop``, when rank 0's end of the pipe closes (rank 0 exited), with its
parent (``PR_SET_PDEATHSIG``), or with an error: a failed collective (another rank
died) or its own, whose traceback it sends rank 0 before exiting with status 1.
"""

from __future__ import annotations

import signal
import socket
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

from tokenrelay.core.runtime import die_with_parent
from tokenrelay.engine.parallel.group import Group, RankSpec

# messages on the pipe: rank 0 -> rank: ("start", RankSpec, device, runner kwargs, pid)
# first, then ("step", StepInput) | ("stop",);
# rank -> rank 0: ("hello",) | ("ready",) | ("error", traceback text)


def main(argv: list[str]) -> None:
    """``python -m tokenrelay.engine.parallel.rank FD``: take the start message, run the rank."""
    sock = socket.socket(fileno=int(argv[0]))
    conn = Connection(sock.detach())
    try:
        kind, spec, device, kwargs, parent = conn.recv()
    except EOFError:
        return  # rank 0 went away before it said who we are
    assert kind == "start", kind
    rank_main(spec, device, kwargs, conn, parent)


def rank_main(
    spec: RankSpec, device: str, runner_kwargs: dict[str, Any], conn: Connection, parent: int
) -> None:
    """The worker rank's whole life (the target of its process)."""
    if not die_with_parent(signal.SIGTERM, parent):
        return  # rank 0 is already gone
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    group: Group | None = None
    try:
        import torch

        from tokenrelay.engine.runner.model_runner import ModelRunner

        conn.send(("hello",))
        group = Group.join(spec, torch.device(device))
        runner = ModelRunner(device=device, group=group, **runner_kwargs)
        conn.send(("ready",))
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # rank 0 exited
                break
            if msg[0] == "stop":
                break
            runner.forward(msg[1])
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        sys.exit(1)
    finally:
        if group is not None:
            group.close()


if __name__ == "__main__":
    main(sys.argv[1:])
