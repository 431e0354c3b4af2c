"""Identical prefill chunks in one step, computed once.

Requests that send the same prompt at the same time (the ``n`` choices of one request,
a client's retries, many users asking the same thing) reach the runner as items whose
chunks are the same tokens at the same positions over the same cached context. The
prefix cache cannot help them: their blocks only enter it once computed, after this
step. Such an item is a *twin* of the first item like it: the runner computes only the
first, copies the blocks it wrote into the twin's blocks, and gives the twin the first
item's logits. The result is the one the twin would have computed itself, bit for bit,
where every matrix product's row depends on its own input only (the CPU kernels;
attention reads each sequence's own context).

Two items are twins when their chunks are equal, start at the same position, that
position is a block boundary, and the blocks before it are the same blocks (shared
through the prefix cache, or none). The scheduler already makes a request wait while
another computes the full blocks of its prompt and then forks them; what twins add is
the last, partial block of the prompt (and a whole prompt whose requests arrive with
nothing running), which every fork would otherwise compute again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenrelay.engine.runner.kv_cache import KVCache
from tokenrelay.engine.runner.step import StepInput


@dataclass(frozen=True)
class TwinPlan:
    """How to run a step with its twins left out, and to fill them in after."""

    reduced: StepInput  # the step without its twins
    src_blocks: list[int]  # blocks the reduced step writes...
    dst_blocks: list[int]  # ...copied into the twins' blocks, pairwise
    rows: list[int]  # per sampling item of the full step: its row in the reduced logits

    def copy_kv(self, kv: KVCache) -> None:
        """Copy the computed blocks into the twins' blocks, in every layer (keys, values)."""
        device = kv.data.device
        src = torch.tensor(self.src_blocks, dtype=torch.int64, device=device)
        dst = torch.tensor(self.dst_blocks, dtype=torch.int64, device=device)
        kv.data[:, :, dst] = kv.data[:, :, src]  # [layers, 2, blocks, block_size, H, D]

    def expand(self, logits: torch.Tensor) -> torch.Tensor:
        """The reduced step's logits ``[n, V]`` -> the full step's (a row per sampling item)."""
        return logits[torch.tensor(self.rows, dtype=torch.int64, device=logits.device)]


def plan_twins(step: StepInput, block_size: int) -> TwinPlan | None:
    """The plan for ``step``, or ``None`` when no item is a twin of another."""
    first: dict[tuple[int, tuple[int, ...], tuple[int, ...]], int] = {}
    source: dict[int, int] = {}  # twin item -> the item it copies
    for i, ids in enumerate(step.token_ids):
        start = step.starts[i]
        if start % block_size:
            continue
        key = (start, tuple(step.block_tables[i][: start // block_size]), tuple(ids))
        j = first.setdefault(key, i)
        if j != i:
            source[i] = j
    if not source:
        return None
    keep = [i for i in range(len(step.token_ids)) if i not in source]
    sampled = set(step.sampling)
    # an item that samples, or whose twin does, gets logits in the reduced step
    wanted = sampled | {source[i] for i in source if i in sampled}
    position = {item: n for n, item in enumerate(keep)}
    reduced_sampling = [position[i] for i in keep if i in wanted]
    row_of = {item: r for r, item in enumerate(i for i in keep if i in wanted)}
    src_blocks: list[int] = []
    dst_blocks: list[int] = []
    for twin, src in source.items():
        start, end = step.starts[twin], step.starts[twin] + len(step.token_ids[twin])
        for b in range(start // block_size, -(-end // block_size)):
            src_blocks.append(step.block_tables[src][b])
            dst_blocks.append(step.block_tables[twin][b])
    reduced = StepInput(
        [step.token_ids[i] for i in keep],
        [step.starts[i] for i in keep],
        [step.block_tables[i] for i in keep],
        reduced_sampling,
    )
    rows = [row_of[source.get(i, i)] for i in step.sampling]
    return TwinPlan(reduced, src_blocks, dst_blocks, rows)
