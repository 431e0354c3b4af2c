"""Logit edits before sampling: logit bias, repetition, frequency and presence penalties.

vLLM's semantics and order (``vllm/v1/sample/sampler.py``): the bias is added
first, then the repetition penalty divides a positive logit (multiplies a
negative one) of every token seen in the prompt or the output so far, then
``frequency_penalty * count + presence_penalty`` is subtracted from the logit of
every token the output holds ``count`` times.

The bias touches only the tokens a row names: one sparse add for the batch. The
penalties are computed for all the rows that use them at once, one of two ways
with the same result:

- *dense* (vLLM's, the default on a GPU): the rows' tokens go to the device as
  one padded ``[S, L]`` tensor; one ``scatter_add`` counts each row's output
  tokens, one ``scatter`` marks the tokens it has seen, and the formula runs
  elementwise over those rows' ``[S, V]`` logits with per-row penalty columns.
  O(S x V) device work, nothing per token on the host but building the tensor.
- *sparse* (the default on a CPU, where O(S x V) is the expensive part and a
  history is far shorter than the vocabulary): one host sort of
  ``row * V + token`` keys gives each row's distinct tokens and output counts,
  and one gather/scatter per penalty edits only those logits.

Each edited logit depends only on its own row (its logits, params and tokens):
a seeded row samples the same token whatever shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tokenrelay.core.wire.params import SamplingParams

__all__ = ["edit_logits"]


def edit_logits(
    logits: torch.Tensor,
    rows: Sequence[int],
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int] | None],
    output_counts: Sequence[int],
    *,
    dense: bool | None = None,
) -> None:
    """Apply the bias and penalties of ``rows`` to ``logits`` ``[N, V]``, in place.

    ``histories[i]``: row ``i``'s prompt followed by its output so far (needed
    when a penalty is on), of which the last ``output_counts[i]`` are output.
    ``dense``: the penalties' way (``None``: dense on CUDA, sparse elsewhere).
    """
    vocab = logits.shape[1]
    bias_r: list[int] = []
    bias_t: list[int] = []
    bias_v: list[float] = []
    penalised: list[int] = []
    for i in rows:
        p = params[i]
        for tok, bias in p.logit_bias.items():
            if tok < vocab:
                bias_r.append(i)
                bias_t.append(tok)
                bias_v.append(bias)
        if p.uses_history:
            if histories[i] is None:
                raise ValueError(f"row {i}: penalties need the tokens so far (past_token_ids)")
            penalised.append(i)
    if bias_r:
        index = (_ids(bias_r, logits.device), _ids(bias_t, logits.device))
        biases = torch.tensor(bias_v, dtype=logits.dtype, device=logits.device)
        logits.index_put_(index, biases, accumulate=True)
    if not penalised:
        return
    past = [histories[i] or () for i in penalised]
    outs = [output_counts[i] for i in penalised]
    sel = [params[i] for i in penalised]
    if dense is None:
        dense = logits.device.type == "cuda"
    (_dense if dense else _sparse)(logits, penalised, sel, past, outs)


def _dense(
    logits: torch.Tensor,
    rows: Sequence[int],
    sel: Sequence[SamplingParams],
    past: Sequence[Sequence[int]],
    outs: Sequence[int],
) -> None:
    device, dtype, vocab = logits.device, logits.dtype, logits.shape[1]
    width = max(1, max(len(h) for h in past))
    ids = np.full((len(rows), width), vocab, dtype=np.int64)  # pads count in column V
    first_out = np.empty(len(rows), dtype=np.int64)
    for j, history in enumerate(past):
        ids[j, : len(history)] = history
        first_out[j] = len(history) - outs[j]
    tokens = torch.from_numpy(ids).to(device).clamp_(max=vocab)  # (ids past V: ignored)
    every = len(rows) == logits.shape[0]  # (rows are increasing: all of them, in order)
    index = _ids(rows, device)
    sub = logits if every else logits.index_select(0, index)  # [S, V]
    rep = [p.repetition_penalty for p in sel]
    if any(r != 1.0 for r in rep):
        seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, tokens, True)
        column = torch.tensor(rep, dtype=dtype, device=device)[:, None]
        penalty = torch.where(seen[:, :vocab], column, torch.ones((), dtype=dtype, device=device))
        sub = torch.where(sub > 0, sub / penalty, sub * penalty)
    if any(p.frequency_penalty or p.presence_penalty for p in sel):
        positions = torch.arange(width, device=device)[None, :]
        starts = torch.from_numpy(first_out).to(device)[:, None]
        outputs = torch.where(positions >= starts, tokens, vocab)
        counts = torch.zeros(len(rows), vocab + 1, dtype=dtype, device=device)
        counts.scatter_add_(1, outputs, torch.ones(outputs.shape, dtype=dtype, device=device))
        counts = counts[:, :vocab]
        freq = torch.tensor([p.frequency_penalty for p in sel], dtype=dtype, device=device)
        pres = torch.tensor([p.presence_penalty for p in sel], dtype=dtype, device=device)
        sub = sub - freq[:, None] * counts - pres[:, None] * (counts > 0).to(dtype)
    if every:
        logits.copy_(sub)
    else:
        logits.index_copy_(0, index, sub)


def _sparse(
    logits: torch.Tensor,
    rows: Sequence[int],
    sel: Sequence[SamplingParams],
    past: Sequence[Sequence[int]],
    outs: Sequence[int],
) -> None:
    device, dtype, vocab = logits.device, logits.dtype, logits.shape[1]
    seen_keys: list[np.ndarray] = []
    out_keys: list[np.ndarray] = []
    for row, p, history, n_out in zip(rows, sel, past, outs, strict=True):
        ids = np.asarray(history, dtype=np.int64)
        ids = ids[ids < vocab] if len(ids) and ids.max() >= vocab else ids
        if p.repetition_penalty != 1.0:
            seen_keys.append(ids + row * vocab)
        if (p.frequency_penalty or p.presence_penalty) and n_out > 0:
            out_keys.append(ids[len(ids) - n_out :] + row * vocab)
    per_row = np.zeros((max(rows) + 1, 3))  # a row's repetition, frequency, presence
    for row, p in zip(rows, sel, strict=True):
        per_row[row] = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
    if seen_keys:
        keys = np.unique(np.concatenate(seen_keys), return_counts=True)[0]  # (sort-based)
        r, t = _split(keys, vocab, device)
        penalty = _column(per_row[keys // vocab, 0], dtype, device)
        vals = logits[r, t]
        logits[r, t] = torch.where(vals > 0, vals / penalty, vals * penalty)
    if out_keys:
        keys, counts = np.unique(np.concatenate(out_keys), return_counts=True)
        r, t = _split(keys, vocab, device)
        of = per_row[keys // vocab]
        freq, pres = _column(of[:, 1], dtype, device), _column(of[:, 2], dtype, device)
        logits[r, t] = logits[r, t] - freq * _column(counts, dtype, device) - pres


def _column(values: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values)).to(device=device, dtype=dtype)


def _split(keys: np.ndarray, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and token index tensors of ``row * vocab + token`` keys."""
    rows, toks = np.divmod(keys, vocab)
    return torch.from_numpy(rows).to(device), torch.from_numpy(toks).to(device)


def _ids(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
