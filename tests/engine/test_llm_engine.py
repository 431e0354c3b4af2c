"""LLMEngine / LLM on the real default model: streaming, finish reasons, abort,
prefix cache, seeded sampling, bad input."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tokenrelay.engine import LLM, EngineConfig, LLMEngine, RequestOutput, SamplingParams


def drain(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step until nothing is unfinished; every output, grouped by request."""
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def text_of(outs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outs)


def ids_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_public_imports() -> None:
    from tokenrelay import engine

    for name in ("LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput"):
        assert getattr(engine, name) is not None
    assert engine.CompletionOutput is not None


def test_stream_deltas_add_up_to_the_decoded_ids(llm_engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    n = llm_engine.add_request("stream", "Write a list of fruits:\n1.", params)
    outs = drain(llm_engine)["stream"]
    assert n == outs[-1].prompt_tokens > 0
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 24
    ids = ids_of(outs)
    assert len(ids) == 24
    assert text_of(outs) == llm_engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_eos_ends_with_stop_and_never_shows_in_text(
    llm_engine: LLMEngine, greedy_prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    eos = llm_engine.eos_token_ids
    case = next((i for i, ref in enumerate(hf_greedy) if any(t in eos for t in ref[:-1])), None)
    assert case is not None, "no reference completion reaches EOS"
    ref = hf_greedy[case]
    end = next(i for i, t in enumerate(ref) if t in eos)
    llm_engine.add_request(
        "eos", greedy_prompts[case], SamplingParams(max_tokens=64, temperature=0)
    )
    outs = drain(llm_engine)["eos"]
    assert outs[-1].finish_reason == "stop"
    assert ids_of(outs) == ref[: end + 1]  # the EOS id is in token_ids...
    expected = llm_engine.tokenizer.decode(ref[:end], skip_special_tokens=True)
    assert text_of(outs) == expected  # ...but never in the text


def test_stop_string_ends_with_stop_and_never_leaks(
    llm_engine: LLMEngine, greedy_prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    tok = llm_engine.tokenizer
    full = tok.decode(hf_greedy[2], skip_special_tokens=True)  # a story: plenty of text
    cut = len(full) // 2
    stop = full[cut : cut + 5]
    assert stop.strip()
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, stop=[stop, "@@@"])
    llm_engine.add_request("stopstr", greedy_prompts[2], params)
    outs = drain(llm_engine)["stopstr"]
    assert outs[-1].finish_reason == "stop"
    assert text_of(outs) == full[: full.index(stop)]
    assert stop not in text_of(outs)


def test_abort_mid_generation_returns_every_block(llm_engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    for i in range(3):
        llm_engine.add_request(f"ab{i}", f"Count from {i} to one thousand: {i},", params)
    for _ in range(3):
        llm_engine.step()
    assert llm_engine.stats()["running"] == 3
    assert llm_engine.abort("ab1")
    llm_engine.add_request("ab-waiting", "Never runs", params)
    assert llm_engine.abort("ab-waiting")  # aborted before its first step
    assert not llm_engine.abort("no-such-request")
    outs = llm_engine.step()
    aborted = {o.request_id: o for o in outs if o.finish_reason == "cancelled"}
    assert set(aborted) == {"ab1", "ab-waiting"}
    assert all(o.finished and o.new_text == "" and not o.new_token_ids for o in aborted.values())
    assert aborted["ab1"].completion_tokens >= 3
    assert not llm_engine.abort("ab1")  # gone
    others = [o for o in outs if o.request_id in ("ab0", "ab2")]
    assert len(others) == 2 and not any(o.finished for o in others)  # the rest goes on
    llm_engine.abort("ab0")
    llm_engine.abort("ab2")
    drain(llm_engine)
    stats = llm_engine.stats()
    # Every block is unreferenced again; full blocks stay cached (and count as free).
    assert stats["blocks_free"] == stats["blocks_total"]
    assert stats["blocks_cached"] >= stats["blocks_cached_free"] > 0
    assert stats["running"] == stats["waiting"] == 0


def test_prefix_cache_computes_only_the_new_tokens(llm_engine: LLMEngine) -> None:
    rng = random.Random(7)
    prefix = [rng.randrange(100, 40000) for _ in range(500)]  # unseen by the cache
    first, second = [*prefix, 11, 12, 13], [*prefix, 21, 22, 23, 24, 25]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    before = llm_engine.stats()
    llm_engine.add_request("pfx1", first, params)
    drain(llm_engine)
    mid = llm_engine.stats()
    assert mid["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(first)
    assert mid["prefix_cache_hit_tokens"] == before["prefix_cache_hit_tokens"]
    llm_engine.add_request("pfx2", second, params)
    drain(llm_engine)
    after = llm_engine.stats()
    hit = after["prefix_cache_hit_tokens"] - mid["prefix_cache_hit_tokens"]
    computed = after["prompt_tokens_computed"] - mid["prompt_tokens_computed"]
    block = llm_engine.block_size
    assert hit == (500 // block) * block  # every full block of the shared prefix
    assert computed == len(second) - hit  # only the tail: 500 % 16 + 5 tokens
    assert computed < 2 * block


def test_seeded_sampling_is_reproducible_across_batch_compositions(
    llm_engine: LLMEngine,
) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    prompt = "My favourite animal is"

    def sample(companions: int, tag: str, seed: int = 1234) -> list[int]:
        llm_engine.add_request(f"seed-{tag}", prompt, replace(seeded, seed=seed))
        for j in range(companions):
            other = SamplingParams(max_tokens=4 + 3 * j, temperature=1.0, top_k=5 * j)
            llm_engine.add_request(f"seed-{tag}-{j}", f"Another {j} prompt " * (j + 1), other)
        return ids_of(drain(llm_engine)[f"seed-{tag}"])

    alone = sample(0, "a")
    assert len(alone) == 12
    assert sample(3, "b") == alone  # joined by others, who leave early
    assert sample(1, "c") == alone
    assert sample(0, "d", seed=99) != alone


def test_bad_input_raises_value_error_and_running_requests_go_on(
    llm_engine: LLMEngine,
) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm_engine.add_request("steady", "The alphabet: a, b, c,", params)
    llm_engine.step()
    too_long = [5] * llm_engine.max_model_len
    bad_requests: list[tuple[str, object, str]] = [
        ("empty-str", "", "prompt"),
        ("empty-list", [], "prompt"),
        ("too-long", too_long, "prompt"),
        ("oov", [1, 2, 10**7], "prompt"),
        ("negative", [1, -3], "prompt"),
        ("steady", "duplicate id", "request_id"),
    ]
    for rid, prompt, field in bad_requests:
        with pytest.raises(ValueError, match=field):
            llm_engine.add_request(rid, prompt, params)  # type: ignore[arg-type]
    for kwargs, field in [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model"):
        EngineConfig(model="/no/such/model/dir")
    with pytest.raises(ValueError, match="model"):
        LLM(model="/no/such/model/dir")
    with pytest.raises(ValueError, match="role"):
        llm_engine.apply_chat_template([{"role": "wizard", "content": "hi"}])
    with pytest.raises(ValueError, match="content"):
        llm_engine.apply_chat_template([{"role": "user", "content": 3}])  # type: ignore[dict-item]
    outs = drain(llm_engine)
    assert set(outs) == {"steady"}  # no trace of the bad requests
    assert outs["steady"][-1].finish_reason == "length"
    assert len(ids_of(outs["steady"])) == 11  # one token came in the first step


def test_llm_generate_keeps_order_and_accepts_every_prompt_form(
    llm_engine: LLMEngine, greedy_prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    llm = LLM.from_engine(llm_engine)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate([greedy_prompts[5], greedy_prompts[0], greedy_prompts[12]], greedy)
    for out, i in zip(outs, (5, 0, 12), strict=True):
        assert out.token_ids == hf_greedy[i][:8]
        assert out.finish_reason == "length" and out.prompt_tokens == len(greedy_prompts[i])
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    (single,) = llm.generate("The capital of France is", greedy)
    assert single.token_ids == hf_greedy[0][:8]
    per_prompt = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 5)]
    outs = llm.generate(["a", "b"], per_prompt)
    assert [len(o.token_ids) for o in outs] == [3, 5]
    with pytest.raises(ValueError, match="params"):
        llm.generate(["a", "b"], per_prompt[:1])
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", ""], greedy)
    assert not llm_engine.has_unfinished()  # the good prompt of the bad batch was dropped


def test_stats_report_the_documented_keys(llm_engine: LLMEngine) -> None:
    stats = llm_engine.stats()
    for key in (
        "blocks_total",
        "blocks_free",
        "blocks_cached",
        "running",
        "waiting",
        "prefix_cache_hit_tokens",
        "prompt_tokens_computed",
        "preemptions",
        "num_steps",
    ):
        assert isinstance(stats[key], int), key
