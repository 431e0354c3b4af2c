"""LLMEngine on the real model: logprobs against transformers, penalties, logit bias,
stop token ids, and seeded rows that stay put whatever the batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.test_llm_engine import drain, ids_of, text_of
from tokenrelay.engine import LLMEngine, RequestOutput, SamplingParams

TOKENS = 12


def hf_logprobs(hf_model: Any, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """transformers' log-softmax of the logits before each completion token ``[n, V]``."""
    ids = torch.tensor([prompt + completion])
    with torch.inference_mode():
        out = hf_model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(out, dim=-1)


def test_greedy_logprobs_match_transformers(
    llm_engine: LLMEngine, hf_model: Any, greedy_prompts: list[list[int]]
) -> None:
    prompts = [greedy_prompts[0], greedy_prompts[9], greedy_prompts[11]]
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    for i, prompt in enumerate(prompts):
        llm_engine.add_request(f"lp{i}", prompt, params)
    outs = drain(llm_engine)
    for i, prompt in enumerate(prompts):
        got = outs[f"lp{i}"]
        ids = ids_of(got)
        entries = [e for o in got for e in (o.new_logprobs or [])]
        assert len(entries) == len(ids) == TOKENS
        ref = hf_logprobs(hf_model, prompt, ids)
        for pos, (tok, e) in enumerate(zip(ids, entries, strict=True)):
            assert e.chosen.logprob == pytest.approx(ref[pos, tok].item(), abs=1e-3)
            text, raw = llm_engine.token_texts(tok)
            assert (e.chosen.token, e.chosen.raw) == (text, raw)
            assert len(e.top) == 5
            assert e.top[0].raw == e.chosen.raw  # greedy: the chosen one is the most likely
            values = [t.logprob for t in e.top]
            assert values == sorted(values, reverse=True)
            want = ref[pos].topk(5).values.tolist()
            assert values == pytest.approx(want, abs=1e-3)


def test_no_logprobs_unless_asked(llm_engine: LLMEngine) -> None:
    llm_engine.add_request("none", "Hello", SamplingParams(max_tokens=3, temperature=0))
    assert all(o.new_logprobs is None for o in drain(llm_engine)["none"])


def test_stop_token_ids_end_the_completion(llm_engine: LLMEngine) -> None:
    base = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    llm_engine.add_request("free", "1, 2, 3, 4, 5,", base)
    free = ids_of(drain(llm_engine)["free"])
    stop = free[4]
    first = free.index(stop)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    llm_engine.add_request("stopped", "1, 2, 3, 4, 5,", params)
    outs = drain(llm_engine)["stopped"]
    assert ids_of(outs) == free[: first + 1]
    assert outs[-1].finish_reason == "stop"
    # vLLM's semantics: a stop token that is not special keeps its text
    assert text_of(outs) == llm_engine.tokenizer.decode(free[: first + 1])


def max_repeats(outs: list[RequestOutput]) -> int:
    ids = ids_of(outs)
    return max(ids.count(t) for t in set(ids))


def test_penalties_cut_repetition(llm_engine: LLMEngine) -> None:
    prompt = "1, 2, 1, 2, 1, 2, 1, 2,"
    runs = {
        "plain": SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        "freq": SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=2.0
        ),
        "rep": SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=2),
    }
    for name, params in runs.items():
        llm_engine.add_request(name, prompt, params)
    outs = drain(llm_engine)
    assert max_repeats(outs["plain"]) >= 8  # the model loops on its own
    assert max_repeats(outs["freq"]) < max_repeats(outs["plain"])
    assert max_repeats(outs["rep"]) < max_repeats(outs["plain"])


def test_logit_bias_steers_greedy(llm_engine: LLMEngine) -> None:
    base = SamplingParams(max_tokens=1, temperature=0)
    llm_engine.add_request("free", "The capital of France is", base)
    top = ids_of(drain(llm_engine)["free"])[0]
    banned = SamplingParams(max_tokens=1, temperature=0, logit_bias={top: -100})
    forced = SamplingParams(max_tokens=3, temperature=0, logit_bias={42: 100})
    llm_engine.add_request("banned", "The capital of France is", banned)
    llm_engine.add_request("forced", "The capital of France is", forced)
    outs = drain(llm_engine)
    assert ids_of(outs["banned"])[0] != top
    assert ids_of(outs["forced"]) == [42, 42, 42]


def test_token_ids_outside_the_vocabulary_are_refused(llm_engine: LLMEngine) -> None:
    vocab = llm_engine.vocab_size
    for params in (
        SamplingParams(logit_bias={vocab: 1}),
        SamplingParams(stop_token_ids=[vocab + 5]),
    ):
        with pytest.raises(ValueError, match=r"token ids must be in \[0, "):
            llm_engine.add_request("bad", "Hi", params)
    assert not llm_engine.has_unfinished()


def test_seeded_penalised_row_is_the_same_alone_and_in_a_crowd(llm_engine: LLMEngine) -> None:
    seeded = SamplingParams(
        max_tokens=10,
        temperature=0.9,
        seed=4242,
        frequency_penalty=0.7,
        presence_penalty=0.3,
        repetition_penalty=1.2,
        min_p=0.05,
        logit_bias={11: 3.0},
        logprobs=2,
    )
    prompt = "Once upon a time"
    llm_engine.add_request("alone", prompt, seeded)
    alone = drain(llm_engine)["alone"]
    crowd = [
        SamplingParams(max_tokens=7, temperature=0),
        SamplingParams(max_tokens=12, temperature=1.2, frequency_penalty=1.0),
        SamplingParams(max_tokens=5, temperature=0.5, seed=1, logprobs=4),
    ]
    for i, params in enumerate(crowd):
        llm_engine.add_request(f"other{i}", f"Story number {i}:", params)
    llm_engine.add_request("crowd", prompt, seeded)
    together = drain(llm_engine)["crowd"]
    assert ids_of(together) == ids_of(alone)
    lp = [e.chosen.logprob for o in together for e in (o.new_logprobs or [])]
    want = [e.chosen.logprob for o in alone for e in (o.new_logprobs or [])]
    assert lp == pytest.approx(want, abs=1e-4)
