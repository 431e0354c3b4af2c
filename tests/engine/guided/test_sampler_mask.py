"""The sampler's grammar mask: guided rows take only allowed tokens, after the logit
bias; their logprobs stay the raw ones; unconstrained rows are untouched."""

from __future__ import annotations

from typing import Any

import torch

from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.response_format import parse_response_format
from tokenrelay.engine.runner.sampler import Sampler

VOCAB = 49152
OBJECT = parse_response_format({"type": "json_object"})


def test_guided_rows_are_masked_and_free_rows_are_not(compiler: Any) -> None:
    assert OBJECT is not None
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    brace = int(compiler.matcher(OBJECT).allowed()[0])  # the only way to start: "{"...
    logits[:, 0] = 50.0  # token 0 wins every unmasked row
    greedy = SamplingParams(temperature=0.0, logprobs=1)
    sampled = SamplingParams(temperature=1.0, seed=1)
    params = [greedy, greedy, sampled, sampled]
    matchers = [None, compiler.matcher(OBJECT), None, compiler.matcher(OBJECT)]
    raw = torch.log_softmax(logits, dim=-1)
    out = Sampler().sample(logits.clone(), params, [0, 0, 0, 0], None, matchers)
    tokens = out.tokens.tolist()
    assert tokens[0] == 0 and tokens[2] == 0
    for row in (1, 3):
        allowed = set(matchers[row].allowed().tolist())  # type: ignore[union-attr]
        assert tokens[row] in allowed and 0 not in allowed
    assert brace in set(matchers[1].allowed().tolist())  # type: ignore[union-attr]
    assert out.logprobs is not None and out.logprobs[1] is not None
    assert abs(out.logprobs[1].logprob - raw[1, tokens[1]].item()) < 1e-4  # raw logits


def test_a_batch_without_matchers_is_unchanged(compiler: Any) -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    params = [SamplingParams(temperature=0.0)] * 3
    plain = Sampler().sample(logits.clone(), params, [0, 0, 0]).tokens
    none_guided = Sampler().sample(logits.clone(), params, [0, 0, 0], None, [None] * 3).tokens
    assert plain.tolist() == none_guided.tolist() == logits.argmax(-1).tolist()
