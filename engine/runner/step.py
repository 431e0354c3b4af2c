"""One engine step's batch as plain values (token ids, positions, block tables).

What the runner builds its tensors from, and what rank 0 of a tensor-parallel
engine sends the other ranks each step (engine/parallel/workers.py): small and
picklable, with none of the requests' sampling state.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenrelay.engine.scheduling.batch import BatchItem


@dataclass
class StepInput:
    """One step's batch as plain values: what every tensor-parallel rank needs to run it."""

    token_ids: list[list[int]]  # per item: the tokens computed this step
    starts: list[int]  # per item: tokens already in the cache
    block_tables: list[list[int]]  # per item: its blocks, in logical order
    sampling: list[int]  # the items whose last token gets logits

    @classmethod
    def of(cls, items: list[BatchItem]) -> StepInput:
        """The values of the scheduler's ``items`` (in their order)."""
        return cls(
            [it.token_ids for it in items],
            [it.start_pos for it in items],
            [it.block_table for it in items],
            [i for i, it in enumerate(items) if it.sample],
        )
