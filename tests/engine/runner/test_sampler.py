"""Batched sampler: exact greedy, top-k/top-p limits, seeds, distributions."""

from __future__ import annotations

import math

import pytest
import torch

from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.engine.runner.sampler import TOP_P_CANDIDATES, Sampler, greedy

VOCAB = 1000


def logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_exact_argmax() -> None:
    x = logits(32)
    out = Sampler(0)(x, [SamplingParams(temperature=0)] * 32, [0] * 32)
    assert out.tolist() == x.argmax(-1).tolist()


def test_greedy_picks_what_torch_argmax_picks() -> None:
    """Ties go to the first maximum, a NaN beats everything, -inf rows still pick one."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(-2, 3, (64, 300), generator=gen).float()  # many ties
    x[1, 10], x[1, 20] = float("nan"), float("nan")
    x[2, 5] = float("inf")
    x[3] = float("-inf")
    x[4, :2] = torch.tensor([-0.0, 0.0])
    x[4, 2:] = -1.0
    x[5, 100:] = float("nan")
    wide = logits(3, seed=8, vocab=49152)
    for t in (x, x[:, ::3], x.T.contiguous().T, wide, x[:0]):
        out = greedy(t)
        assert out.dtype == torch.int64
        assert out.tolist() == t.argmax(dim=-1).tolist()


def test_greedy_rows_stay_exact_in_a_mixed_batch() -> None:
    x = logits(16, seed=1)
    params = [
        SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=1.5, top_p=0.8)
        for i in range(16)
    ]
    out = Sampler(0)(x, params, list(range(16)))
    for i in range(1, 16, 2):
        assert out[i].item() == x[i].argmax().item()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
        SamplingParams(temperature=0.7, top_k=5, top_p=1e-6),
        SamplingParams(temperature=1e-4),
    ],
)
def test_degenerate_sampling_equals_greedy(params: SamplingParams) -> None:
    x = logits(64, seed=2)
    out = Sampler()(x, [params] * 64, list(range(64)))
    assert out.tolist() == x.argmax(-1).tolist()


def test_seed_gives_same_tokens_whatever_shares_the_batch() -> None:
    x = logits(8, seed=3)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    others = [SamplingParams(temperature=1.3), SamplingParams(temperature=0), seeded]
    # alone
    alone = [Sampler()(x[:1], [seeded], [i]).item() for i in range(20)]
    # as row 5 among 7 others (different params), with a different sampler instance
    mixed = []
    for i in range(20):
        params = [others[j % 3] for j in range(8)]
        params[5] = seeded
        batch = x.clone()
        batch[5] = x[0]
        mixed.append(Sampler(99)(batch, params, [i] * 8)[5].item())
    assert alone == mixed
    assert len(set(alone)) > 1  # different output_index, different draws


def test_unseeded_rows_vary() -> None:
    x = torch.zeros(200, VOCAB)
    out = Sampler()(x, [SamplingParams(temperature=1.0)] * 200, [0] * 200)
    assert len(set(out.tolist())) > 150


def test_temperature_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    x = probs.log().repeat(20000, 1)
    sampler = Sampler(0)
    for temp in (1.0, 2.0):
        out = sampler(x, [SamplingParams(temperature=temp)] * len(x), [0] * len(x))
        freq = torch.bincount(out, minlength=4).double() / len(x)
        expected = probs.double() ** (1 / temp)
        expected /= expected.sum()
        assert (freq - expected).abs().max().item() < 0.015, (temp, freq, expected)


def test_top_k_and_top_p_keep_only_their_sets() -> None:
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    x = probs.log().repeat(5000, 1)
    sampler = Sampler(0)
    out = sampler(x, [SamplingParams(top_k=2)] * len(x), [0] * len(x))
    freq = torch.bincount(out, minlength=5).double() / len(x)
    assert set(out.tolist()) == {0, 1}
    assert abs(freq[0].item() - 0.4 / 0.65) < 0.03
    # nucleus 0.8: 0.4 + 0.25 = 0.65 < 0.8 -> needs token 2 too; 0.85 >= 0.8 stops there
    out = sampler(x, [SamplingParams(top_p=0.8)] * len(x), [0] * len(x))
    assert set(out.tolist()) == {0, 1, 2}
    # top-p applies to the renormalised top-k mass: top_k=3 -> 0.4/0.85 = 0.47 >= 0.45
    out = sampler(x, [SamplingParams(top_k=3, top_p=0.45)] * len(x), [0] * len(x))
    assert set(out.tolist()) == {0}


def test_wide_nucleus_falls_back_to_a_full_sort() -> None:
    vocab = 4 * TOP_P_CANDIDATES
    x = torch.zeros(300, vocab)
    x[:, : vocab // 2] = math.log(3.0)  # first half 3x likelier
    out = Sampler(0)(x, [SamplingParams(top_p=0.7)] * 300, [0] * 300)
    # nucleus 0.7 < 0.75 (the first half's mass) -> only first-half tokens
    assert out.max().item() < vocab // 2
    assert len(set(out.tolist())) > 100


def test_a_nucleus_inside_the_candidates_is_of_the_whole_mass() -> None:
    """Top-p alone keeps the tokens needed to reach ``top_p`` of the whole row, even when
    the candidates it looks at hold less than all of it (a long tail)."""
    vocab = 4 * TOP_P_CANDIDATES
    probs = torch.full((vocab,), 0.5 / (vocab - 10))
    probs[:10] = torch.linspace(0.10, 0.0, 10)[:10] + 0.005  # 10 likely tokens: half the mass
    probs[:10] *= 0.5 / probs[:10].sum()
    before = torch.cat([torch.zeros(1), probs[:9].cumsum(0)])
    nucleus = {i for i in range(10) if before[i] < 0.45}  # exact: mass before < top_p
    out = Sampler(0)(probs.log().repeat(3000, 1), [SamplingParams(top_p=0.45)] * 3000, [0] * 3000)
    assert set(out.tolist()) == nucleus, (sorted(set(out.tolist())), sorted(nucleus))


def test_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler()(logits(2), [SamplingParams()], [0])
