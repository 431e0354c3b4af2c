"""The process group of a tensor-parallel model and the collectives one step makes.

One group per process: ranks meet through a ``TCPStore`` that rank 0 serves on a
free local port, then :func:`torch.distributed.init_process_group` with ``gloo``
(CPU) or ``nccl`` (CUDA) and a timeout on every collective, so a rank that stops
answering ends a step with an error instead of hanging it. gloo also fails a
collective at once when a peer's connection closes (a rank that died).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from tokenrelay.engine.errors import TensorParallelError

if TYPE_CHECKING:
    from tokenrelay.engine.runner.step import StepInput

# seconds any collective (and the rendezvous) may wait for the slowest rank
COLLECTIVE_TIMEOUT_S = 120.0
HOST = "127.0.0.1"  # ranks run on one machine


class Peers(Protocol):
    """Rank 0's view of the other ranks (:class:`engine.parallel.workers.RankWorkers`)."""

    def publish(self, step: StepInput) -> None:
        """Hand this step's batch to every other rank (before rank 0 runs it)."""
        ...

    def check(self) -> None:
        """Raise :class:`TensorParallelError` when a rank is gone."""
        ...

    def failure(self, exc: BaseException) -> TensorParallelError:
        """The error to raise for ``exc``, a collective that failed (names the dead rank)."""
        ...

    def close(self) -> None:
        """Stop the other ranks (idempotent)."""
        ...


@dataclass(frozen=True)
class RankSpec:
    """Where one rank finds the others: sent to each worker rank when it starts."""

    rank: int
    size: int
    backend: str  # "gloo" or "nccl"
    port: int  # of rank 0's TCPStore on HOST
    timeout_s: float = COLLECTIVE_TIMEOUT_S


def backend_for(device: torch.device) -> str:
    """``nccl`` for CUDA devices, ``gloo`` for the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


class Group:
    """This process's rank in the (default) process group and the model's collectives.

    Rank 0 also holds :attr:`peers`, through which it feeds every step to the others.
    """

    def __init__(self, spec: RankSpec, device: torch.device, store: dist.Store) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "tensor parallel: this process already runs a tensor-parallel engine "
                "(one at a time: close() it first)"
            )
        self.rank, self.size, self.device = spec.rank, spec.size, device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            spec.backend,
            store=store,
            rank=spec.rank,
            world_size=spec.size,
            timeout=datetime.timedelta(seconds=spec.timeout_s),
        )
        self.peers: Peers | None = None
        self.closed = False

    @classmethod
    def join(cls, spec: RankSpec, device: torch.device) -> Group:
        """A worker rank: connect to rank 0's store and join the group."""
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore(HOST, spec.port, spec.size, is_master=False, timeout=timeout)
        return cls(spec, device, store)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; every rank gets the same values."""
        dist.all_reduce(x)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Each rank's ``[N, Vp]`` logits -> the whole ``[N, vocab_size]`` (on every rank)."""
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits)
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def min_int(self, value: int) -> int:
        """The smallest ``value`` of all ranks (the KV pool's block count, for one)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        """Leave the group (idempotent); this process may start another one after."""
        if not self.closed:
            self.closed = True
            if dist.is_initialized():
                dist.destroy_process_group()
