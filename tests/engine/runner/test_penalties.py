"""Penalties, logit bias, min-p and logprobs in the sampler, against their formulas.

The reference is plain numpy (float64) on small logits: vLLM's order and
semantics (bias, then repetition over prompt + output, then frequency x count
+ presence over the output; min-p on the tempered probabilities; logprobs from
the raw logits).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.engine.runner import sampler as sampler_module
from tokenrelay.engine.runner.logprobs import SampleLogprobs
from tokenrelay.engine.runner.penalties import edit_logits
from tokenrelay.engine.runner.sampler import Sampler

VOCAB = 64


def logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def reference(row: np.ndarray, p: SamplingParams, history: list[int], n_out: int) -> np.ndarray:
    """The formula, token by token, in float64."""
    x = row.astype(np.float64).copy()
    for tok, bias in p.logit_bias.items():
        x[tok] += bias
    if p.repetition_penalty != 1.0:
        for tok in set(history):
            x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok, count in Counter(history[len(history) - n_out :]).items():
        x[tok] -= p.frequency_penalty * count + p.presence_penalty
    return x


def random_case(rows: int, seed: int) -> tuple[list[SamplingParams], list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    params, histories, n_outs = [], [], []
    for i in range(rows):
        kind = i % 5
        kw: dict[str, Any] = {"temperature": 0.0}
        if kind in (1, 4):
            kw["frequency_penalty"] = float(rng.uniform(-2, 2))
            kw["presence_penalty"] = float(rng.uniform(-2, 2))
        if kind in (2, 4):
            kw["repetition_penalty"] = float(rng.uniform(0.5, 2.0))
        if kind in (3, 4):
            toks = rng.choice(VOCAB, size=5, replace=False)
            kw["logit_bias"] = {int(t): float(rng.uniform(-100, 100)) for t in toks}
        params.append(SamplingParams(**kw))
        history = rng.integers(0, VOCAB // 2, size=int(rng.integers(1, 40))).tolist()
        histories.append(history)
        n_outs.append(int(rng.integers(0, len(history) + 1)))
    return params, histories, n_outs


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("seed", range(5))
def test_edit_logits_matches_the_formula(seed: int, dense: bool) -> None:
    x = logits(15, seed=seed)
    params, histories, n_outs = random_case(15, seed)
    want = [reference(x[i].numpy(), params[i], histories[i], n_outs[i]) for i in range(15)]
    rows = [i for i, p in enumerate(params) if p.edits_logits]
    edited = x.clone()
    edit_logits(edited, rows, params, histories, n_outs, dense=dense)
    np.testing.assert_allclose(edited.numpy(), np.stack(want), rtol=1e-5, atol=1e-4)
    untouched = [i for i in range(15) if i not in rows]
    assert torch.equal(edited[untouched], x[untouched])


@pytest.mark.parametrize("every", [False, True])
def test_dense_and_sparse_agree_bit_for_bit(every: bool) -> None:
    """The two ways (GPU default, CPU default) give the same floats: same ops, same order."""
    x = logits(20, seed=21)
    params, histories, n_outs = random_case(20, 21)
    if every:  # every row penalised: the dense way edits the logits without selecting rows
        params = [dataclasses.replace(p, presence_penalty=0.5) for p in params]
    rows = [i for i, p in enumerate(params) if p.edits_logits]
    a, b = x.clone(), x.clone()
    edit_logits(a, rows, params, histories, n_outs, dense=False)
    edit_logits(b, rows, params, histories, n_outs, dense=True)
    assert torch.equal(a, b)


def test_greedy_sees_the_penalties() -> None:
    x = logits(10, seed=7)
    params, histories, n_outs = random_case(10, 7)
    out = Sampler()(x.clone(), params, n_outs, histories)
    want = [
        int(np.argmax(reference(x[i].numpy(), params[i], histories[i], n_outs[i])))
        for i in range(10)
    ]
    assert out.tolist() == want


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_frequency_counts_only_the_output_repetition_the_prompt_too(dense: bool) -> None:
    x = torch.zeros(1, VOCAB)
    x[0, 5], x[0, 6] = 2.0, -2.0
    hist = [5, 6, 5, 5]  # prompt [5, 6], output [5, 5]
    freq = SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25)
    a = x.clone()
    edit_logits(a, [0], [freq], [hist], [2], dense=dense)
    assert a[0, 5].item() == pytest.approx(2.0 - 0.5 * 2 - 0.25)
    assert a[0, 6].item() == -2.0  # in the prompt only
    rep = SamplingParams(temperature=0, repetition_penalty=2.0)
    b = x.clone()
    edit_logits(b, [0], [rep], [hist], [2], dense=dense)
    assert b[0, 5].item() == 1.0 and b[0, 6].item() == -4.0
    # nothing output yet: frequency and presence have nothing to count
    c = x.clone()
    edit_logits(c, [0], [freq], [hist[:2]], [0], dense=dense)
    assert torch.equal(c, x)


def test_logit_bias_bans_and_forces() -> None:
    x = logits(4, seed=3)
    top = x.argmax(-1).tolist()
    ban = [SamplingParams(temperature=0, logit_bias={t: -100}) for t in top]
    assert all(
        a != b for a, b in zip(Sampler()(x.clone(), ban, [0] * 4).tolist(), top, strict=True)
    )
    force = [SamplingParams(temperature=1.0, seed=i, logit_bias={9: 100}) for i in range(4)]
    assert Sampler()(x.clone(), force, [0] * 4).tolist() == [9] * 4


def test_min_p_keeps_its_set_with_the_renormalised_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    x = probs.log().repeat(20000, 1)
    params = [SamplingParams(temperature=1.0, min_p=0.2)] * len(x)  # floor 0.1: drops 0.08
    out = Sampler(0)(x, params, [0] * len(x))
    freq = torch.bincount(out, minlength=4).double() / len(x)
    expected = torch.tensor([0.5, 0.3, 0.12, 0.0], dtype=torch.float64) / 0.92
    assert (freq - expected).abs().max().item() < 0.015, freq
    # at temperature 2 the floor moves with the tempered distribution
    tempered = probs.double() ** 0.5 / (probs.double() ** 0.5).sum()
    params = [SamplingParams(temperature=2.0, min_p=0.45)] * len(x)
    out = Sampler(0)(x, params, [0] * len(x))
    assert set(out.tolist()) == {i for i in range(4) if tempered[i] >= 0.45 * tempered[0]}


def test_min_p_with_top_p_applies_top_p_to_what_min_p_kept() -> None:
    probs = torch.tensor([0.4, 0.35, 0.2, 0.05])
    x = probs.log().repeat(3000, 1)
    # min_p 0.2 -> floor 0.08 drops 0.05; renormalised [0.421, 0.368, 0.211]; top_p 0.7 -> {0, 1}
    params = [SamplingParams(temperature=1.0, min_p=0.2, top_p=0.7)] * len(x)
    assert set(Sampler(0)(x, params, [0] * len(x)).tolist()) == {0, 1}


def test_seeded_rows_with_penalties_ignore_the_batch() -> None:
    x = logits(1, seed=11)[0]
    seeded = SamplingParams(
        temperature=0.9,
        seed=77,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        repetition_penalty=1.3,
        min_p=0.02,
        top_k=40,
        logit_bias={3: 5.0},
        logprobs=2,
    )
    history = [1, 2, 3, 3, 4, 10, 3]
    others = [
        SamplingParams(temperature=0, frequency_penalty=2.0),
        SamplingParams(temperature=1.4),
        SamplingParams(temperature=0.7, seed=5, repetition_penalty=0.8, logprobs=5),
        SamplingParams(temperature=1.0, top_p=0.5, min_p=0.3, logit_bias={3: -100}),
    ]

    def run(batch: list[SamplingParams], at: int, index: int) -> tuple[int, SampleLogprobs | None]:
        rows = logits(len(batch), seed=index + 100)
        rows[at] = x
        hists = [[index % VOCAB, 7, 7]] * len(batch)
        hists[at] = history
        got = Sampler(index).sample(rows, batch, [3] * len(batch), hists)
        assert got.logprobs is not None
        return int(got.tokens[at]), got.logprobs[at]

    for index in range(12):
        alone = run([seeded], 0, index)
        for size in (2, 5, 9):
            batch = [others[j % len(others)] for j in range(size)]
            at = size // 2
            batch[at] = seeded
            assert run(batch, at, index) == alone


def test_logprobs_are_the_raw_log_softmax() -> None:
    x = logits(6, seed=5)
    raw = torch.log_softmax(x.double(), dim=-1)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0, logprobs=0, logit_bias={0: 100}),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3, seed=1, logprobs=20, frequency_penalty=2.0),
        SamplingParams(temperature=0.5, seed=2, logprobs=1, min_p=0.5),
        SamplingParams(temperature=0, logprobs=5, repetition_penalty=3.0),
    ]
    got = Sampler().sample(x.clone(), params, [1] * 6, [[0, 1, 2]] * 6)
    assert got.logprobs is not None and got.logprobs[2] is None
    assert got.tokens[1].item() == 0  # the bias decided the token, not the logprob
    for i, p in enumerate(params):
        lp = got.logprobs[i]
        if p.logprobs is None:
            continue
        assert lp is not None and lp.token_id == got.tokens[i].item()
        assert lp.logprob == pytest.approx(raw[i, lp.token_id].item(), abs=1e-5)
        assert len(lp.top_ids) == p.logprobs == len(lp.top_logprobs)
        want = raw[i].topk(p.logprobs)
        assert list(lp.top_ids) == want.indices.tolist()
        np.testing.assert_allclose(lp.top_logprobs, want.values.numpy(), atol=1e-5)
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)


def test_default_rows_take_the_old_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """No edits, no logprobs: the logits are not touched and nothing extra runs."""

    def boom(*args: Any) -> None:
        raise AssertionError("called on a batch that needs nothing")

    monkeypatch.setattr(sampler_module, "edit_logits", boom)
    monkeypatch.setattr(sampler_module, "raw_logprobs", boom)
    x = logits(8, seed=9)
    before = x.clone()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=5)] * 4
    got = Sampler(0).sample(x, params, list(range(8)))
    assert got.logprobs is None and torch.equal(x, before)


def test_a_penalty_without_history_is_an_error() -> None:
    with pytest.raises(ValueError, match="past_token_ids"):
        Sampler()(logits(1), [SamplingParams(presence_penalty=1.0)], [0])


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {i: 1 for i in range(301)}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_params_refuse_bad_values(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_params_take_json_keys() -> None:
    p = SamplingParams(logit_bias={"5": -1, 6: 2}, stop_token_ids=[3])
    assert p.logit_bias == {5: -1.0, 6: 2.0} and p.edits_logits and not p.uses_history
