"""Batched sampling on the device: greedy, temperature, top-k, top-p, per-request seed.

Greedy rows (temperature 0) take ``argmax`` exactly. Other rows are sampled by
inverse CDF: one uniform number per row, drawn on the host from a generator
seeded by ``(seed, output_index)`` for seeded requests, so a seeded row's token
depends only on its own logits, never on what else shares the batch.

Top-k and top-p work on the ``K`` most likely tokens (``K`` = the largest
``top_k`` in the batch, or :data:`TOP_P_CANDIDATES` for top-p only); a row whose
top-p nucleus does not fit in those candidates falls back to a full sort, so the
result is exact either way without sorting the whole vocabulary every step.

vLLM's order around them: the raw log-probabilities of the rows that asked
(:mod:`tokenrelay.engine.runner.logprobs`) are taken first; then logit bias and penalties
edit the logits in place (:mod:`tokenrelay.engine.runner.penalties`; greedy rows see
them too); then greedy rows take their argmax and the others are sampled after
temperature, min-p (tokens less likely than ``min_p`` times the most likely
one dropped, the rest renormalised), top-k and top-p. A batch in which no row
asks for any of these runs exactly the code it ran before they existed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.engine.guided.bitmask import allocate_bitmask, apply_bitmask
from tokenrelay.engine.guided.matcher import GuidedMatcher, fill_bitmask
from tokenrelay.engine.runner.logprobs import SampleLogprobs, gather, raw_logprobs
from tokenrelay.engine.runner.penalties import edit_logits

TOP_P_CANDIDATES = 512
_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: decorrelates (seed, index) pairs


def row_uniform(seed: int, output_index: int) -> float:
    """The uniform draw in ``[0, 1)`` of a seeded request's ``output_index``-th token."""
    return random.Random((seed * _SEED_MIX + output_index) & 0xFFFFFFFFFFFFFFFF).random()


@dataclass
class SamplerOutput:
    """One step's tokens ``[N]``, and the logprobs of the rows that asked (else ``None``)."""

    tokens: torch.Tensor
    logprobs: list[SampleLogprobs | None] | None = None


class Sampler:
    """Turns fp32 logits ``[N, V]`` into one token id per row."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)  # unseeded requests (None: seeded from os.urandom)
        self._bitmask: torch.Tensor | None = None  # host buffer, grown to the batch

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
        histories: Sequence[Sequence[int] | None] | None = None,
    ) -> torch.Tensor:
        """Sample one token per row; returns ``[N]`` int64 on the logits' device."""
        return self.sample(logits, params, output_indices, histories).tokens

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
        histories: Sequence[Sequence[int] | None] | None = None,
        matchers: Sequence[GuidedMatcher | None] | None = None,
    ) -> SamplerOutput:
        """Sample one token per row, with the logprobs of the rows whose params ask.

        ``output_indices[i]``: how many tokens row ``i`` has generated so far;
        ``histories[i]``: its prompt and those tokens (needed only where a penalty
        is on); ``matchers[i]``: row ``i``'s grammar (None: free text; ``matchers``
        None: no row is guided). Rows with a logit bias, a penalty or a grammar have
        their ``logits`` edited in place.
        """
        if logits.dim() != 2 or not logits.shape[0] == len(params) == len(output_indices):
            raise ValueError("logits: expected [N, V] with one SamplingParams per row")
        asked: list[int] = []  # rows that want logprobs
        edited: list[int] = []  # rows with a logit bias or a penalty
        for i, p in enumerate(params):  # one pass: a default batch pays little here
            if p.logprobs is not None:
                asked.append(i)
            if (
                p.logit_bias
                or p.frequency_penalty
                or p.presence_penalty
                or p.repetition_penalty != 1
            ):
                edited.append(i)
        raw = raw_logprobs(logits, asked) if asked else None
        if edited:
            past = histories if histories is not None else [None] * len(params)
            edit_logits(logits, edited, params, past, output_indices)
        if matchers is not None:
            self._mask(logits, matchers)
        tokens = self._tokens(logits, params, output_indices)
        if raw is None:
            return SamplerOutput(tokens)
        index = torch.tensor(asked, device=tokens.device)
        top = [params[i].logprobs or 0 for i in asked]
        logprobs: list[SampleLogprobs | None] = [None] * len(params)
        for i, got in zip(asked, gather(raw, tokens.index_select(0, index), top), strict=True):
            logprobs[i] = got
        return SamplerOutput(tokens, logprobs)

    def _mask(self, logits: torch.Tensor, matchers: Sequence[GuidedMatcher | None]) -> None:
        """Ban what each guided row's grammar forbids next (``-inf``), in one batched pass."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        guided = [m for m in matchers if m is not None]
        vocab = guided[0].vocab_size
        buf = self._bitmask
        if buf is None or buf.shape[0] < len(rows) or buf.shape[1] != (vocab + 31) // 32:
            buf = self._bitmask = allocate_bitmask(max(len(rows), 8), vocab)
        fill_bitmask(guided, buf)
        apply_bitmask(logits, buf[: len(rows)], None if len(rows) == logits.shape[0] else rows)

    def _tokens(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int]
    ) -> torch.Tensor:
        tokens = greedy(logits)  # exact greedy for every row
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens
        device = logits.device
        sel = [params[i] for i in rows]
        index = torch.tensor(rows, device=device)
        temps = torch.tensor([p.temperature for p in sel], device=device, dtype=torch.float32)
        probs = torch.softmax(logits.index_select(0, index) / temps[:, None], dim=-1)  # [S, V]
        if any(p.min_p > 0 for p in sel):
            probs = _min_p(probs, [p.min_p for p in sel])
        uniforms = [
            row_uniform(p.seed, output_indices[i]) if p.seed is not None else self._rng.random()
            for i, p in zip(rows, sel, strict=True)
        ]
        u = torch.tensor(uniforms, device=device, dtype=torch.float32)
        if all(p.top_k == 0 and p.top_p >= 1.0 for p in sel):
            sampled = _inverse_cdf(probs, u)
        else:
            sampled = _sample_filtered(probs, sel, u)
        tokens[index] = sampled
        return tokens


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``: the first maximum of each row, a NaN counting as one.

    fp32 on a CPU goes through numpy, whose vectorised argmax finds the same index
    much sooner than torch's for a large vocabulary.
    """
    cpu = logits.device.type == "cpu" and logits.dtype == torch.float32
    if cpu and logits.dim() == 2 and logits.shape[1] > 0:
        rows = logits.detach().numpy().argmax(axis=-1)
        return torch.from_numpy(rows.astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def _min_p(probs: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Drop the tokens under ``min_p`` times their row's largest probability; renormalise."""
    floor = torch.tensor(min_p, device=probs.device, dtype=probs.dtype)[:, None]
    kept = probs.masked_fill(probs < floor * probs.amax(dim=-1, keepdim=True), 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column ``j`` per row with ``cdf[j-1] <= u * total < cdf[j]`` (``weights`` ``[S, K]``)."""
    cdf = weights.cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    j = torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[1] - 1)
    # a rounding edge can land on a zero-weight column: take the row's most likely one
    fallback = weights.argmax(dim=-1, keepdim=True)
    ok = weights.gather(1, j) > 0
    return torch.where(ok, j, fallback).squeeze(1)


def _sample_filtered(
    probs: torch.Tensor, sel: Sequence[SamplingParams], u: torch.Tensor
) -> torch.Tensor:
    """Top-k then top-p (on the renormalised top-k mass), then inverse-CDF sampling."""
    device = probs.device
    vocab = probs.shape[1]
    k_max = max(p.top_k for p in sel)
    cands = min(vocab, max(k_max, TOP_P_CANDIDATES if any(p.top_p < 1 for p in sel) else 1))
    vals, idx = probs.topk(cands, dim=-1)  # [S, K] descending
    top_k = torch.tensor([p.top_k or vocab for p in sel], device=device)
    top_p = torch.tensor([p.top_p for p in sel], device=device, dtype=torch.float32)
    # a top-p-only row needs the nucleus inside the candidates; else sort the whole row
    short = (top_k > cands) & (vals.sum(dim=-1) < top_p)
    if bool(short.any()):
        vals, idx = probs.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vals.shape[1], device=device)[None, :]
    vals = vals.masked_fill(ranks >= top_k[:, None], 0.0)
    cum = vals.cumsum(dim=-1)
    before = cum - vals  # mass of the more likely tokens
    # top-p is of the top-k mass where a row has top-k, else of the whole row's mass
    # (more than its candidates hold when the nucleus fits inside them)
    mass = torch.where(top_k[:, None] > vals.shape[1], probs.sum(-1, keepdim=True), cum[:, -1:])
    nucleus_done = (before >= top_p[:, None] * mass) & (top_p[:, None] < 1)
    vals = vals.masked_fill(nucleus_done, 0.0)  # the first token always stays
    return idx.gather(1, _inverse_cdf(vals, u)[:, None]).squeeze(1)
