"""The torch-free boundary between the scheduler and the model runner.

The scheduler decides *what* to compute each step and describes it with plain
Python values; the model runner turns that into tensors, runs the model over
the paged KV cache and samples. Neither side imports the other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenrelay.core.wire.params import SamplingParams


@dataclass
class BatchItem:
    """One sequence's share of an engine step.

    Invariants: ``len(block_table) * block_size >= start_pos + len(token_ids)``;
    the KV of positions ``[0, start_pos)`` is already in the blocks of
    ``block_table``; this step writes the KV of ``token_ids`` at positions
    ``start_pos .. start_pos + len(token_ids) - 1``.
    """

    request_id: str
    token_ids: list[int]  # the tokens to compute this step (a prefill chunk, or 1 for decode)
    start_pos: int  # position of token_ids[0] == tokens already in the KV cache
    block_table: list[int]  # physical block ids, in logical order
    sample: bool  # sample a next token after the last of token_ids
    params: SamplingParams
    output_index: int  # how many tokens this request has generated so far (for seeded RNG)
    past_token_ids: list[int] | None = None  # every token so far (only if a sampler needs it)


@dataclass(frozen=True)
class StepStats:
    """What one step computed (for stats and benchmarks)."""

    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
