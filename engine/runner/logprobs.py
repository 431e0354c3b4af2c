"""Log-probabilities of sampled tokens, from the model's raw logits.

As vLLM's default (``logprobs_mode="raw_logprobs"``) and OpenAI document them:
the log-softmax of the logits the model produced, before logit bias,
penalties, temperature, min-p, top-k or top-p. The sampler takes
:func:`raw_logprobs` of the rows that asked before it edits any logit, and
:func:`gather` the sampled token's value and the ``k`` most likely ones after
it has sampled: one device-to-host copy for the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["SampleLogprobs", "gather", "raw_logprobs"]


@dataclass(frozen=True, slots=True)
class SampleLogprobs:
    """One sampled token's log-probability and the ``k`` most likely tokens' (descending)."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def raw_logprobs(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``log_softmax`` in fp32 of ``logits[rows]`` (new memory: later edits do not reach it)."""
    if len(rows) != logits.shape[0]:
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        logits = logits.index_select(0, index)
    return torch.log_softmax(logits.float(), dim=-1)


def gather(
    logprobs: torch.Tensor, tokens: torch.Tensor, top: Sequence[int]
) -> list[SampleLogprobs]:
    """Row ``j``'s value at ``tokens[j]`` and its ``top[j]`` largest values with their ids."""
    rows = logprobs.shape[0]
    chosen = logprobs.gather(1, tokens.view(rows, 1).to(logprobs.device)).view(rows)
    k = min(max(top, default=0), logprobs.shape[1])
    if k > 0:
        values, ids = logprobs.topk(k, dim=-1)
        packed = torch.cat([chosen[:, None], values], dim=1).cpu().tolist()
        id_rows = ids.cpu().tolist()
    else:
        packed = chosen[:, None].cpu().tolist()
        id_rows = [[] for _ in range(rows)]
    out = []
    for j, token in enumerate(tokens.tolist()):
        n = top[j]
        out.append(
            SampleLogprobs(
                int(token), packed[j][0], tuple(id_rows[j][:n]), tuple(packed[j][1 : n + 1])
            )
        )
    return out
