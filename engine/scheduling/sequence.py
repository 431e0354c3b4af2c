"""The state of one request inside the engine (torch-free)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.vocabulary import FinishReason


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute
    RUNNING = "running"  # holds blocks and is scheduled every step
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request: its tokens, how many of them are in the KV cache, its blocks.

    Invariants: ``num_computed_tokens <= len(token_ids)``; every position below
    ``num_computed_tokens`` has its KV written in ``block_table``; a WAITING or
    FINISHED sequence holds no blocks. ``block_hashes[i]`` is the content-chain
    hash of the i-th full block of ``token_ids`` (content, not placement, so it
    survives preemption).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order into the engine, smaller is older
    token_ids: list[int] = field(init=False)  # prompt + output
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_cached_tokens: int = 0  # prefix-cache hit of the latest admission
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than one token still to compute (a prompt, or a recompute after preemption)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
