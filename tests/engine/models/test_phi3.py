"""Phi-3 / Phi-3.5 / Phi-4 (``model_type`` ``phi3``) from Hugging Face folders, against
transformers on random weights, as tests/engine/models/test_families.py checks the others.

Two tiny checkpoints (2 layers, GQA, the default model's tokenizer and vocabulary), both
with ``partial_rotary_factor`` 0.75 (12 of each head's 16 values rotate, as Phi-4-mini's
0.75): ``phi3`` with plain RoPE and a sliding window of 24 tokens on every layer (as
Phi-3-mini-4k's 2047), and ``phi3-longrope`` with ``longrope`` scaling (an original
context of 32 tokens stretched to 128, distinct short and long factors).
transformers (eager attention) takes the short factors while a sequence fits in 32 tokens
and the long ones past that; the engine takes one list for every sequence from the
context it serves (engine/models/rope.py): the long one by default (128 > 32), the short
one under ``max_model_len`` 32. Both are checked on sequences on the same side of 32 as
transformers' choice.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.models.test_families import (
    NEW_TOKENS,
    TIE_GAP,
    TINY,
    Reference,
    prompts,
    randomize,
    run,
)
from tests.engine.models.test_llama import hf_logits, run_chunks, shuffled_blocks
from tokenrelay.engine import EngineConfig, LLMEngine
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.families import model_class
from tokenrelay.engine.models.phi3 import Phi3ForCausalLM
from tokenrelay.engine.models.rope import rope_inv_freq
from tokenrelay.engine.models.weights import load_model
from tokenrelay.engine.runner.kv_cache import KVCache

__all__ = ["prompts"]  # the shared prompts fixture (five prompts, 5 to 93 tokens)

ORIGINAL, STRETCHED = 32, 128
WINDOW = 24  # plain ``phi3``: every layer attends to its last 24 tokens (transformers' mask)
SHORT = [1.0, 1.3, 2.0, 3.0, 5.0, 8.0]  # one per rotated frequency: 12 rotated values / 2
LONG = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]


def phi3_config(kind: str, **overrides: Any) -> Any:
    from transformers import Phi3Config

    fields: dict[str, Any] = dict(
        TINY, max_position_embeddings=STRETCHED, partial_rotary_factor=0.75,
        tie_word_embeddings=False, sliding_window=WINDOW if kind == "phi3" else None,
    )  # fmt: skip
    if kind == "phi3-longrope":
        fields["rope_scaling"] = {"rope_type": "longrope", "short_factor": SHORT,
                                  "long_factor": LONG}  # fmt: skip
        fields["original_max_position_embeddings"] = ORIGINAL
    fields.update(overrides)
    return Phi3Config(**fields)


def build_phi3(kind: str, folder: Path, tokenizer_dir: Path) -> Any:
    """Save a random ``kind`` checkpoint and the default tokenizer in ``folder``; the model."""
    import shutil

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(phi3_config(kind), attn_implementation="eager")
    hf = hf.float().eval()
    randomize(hf)
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return hf


@pytest.fixture(scope="module", params=["phi3", "phi3-longrope"])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_path: Path
) -> tuple[str, Path, Any]:
    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    return kind, folder, build_phi3(kind, folder, model_path)


def _logits(model: Any, cfg: ModelConfig, ids: list[int], chunks: list[int]) -> torch.Tensor:
    cache = KVCache(cfg, num_blocks=32, block_size=8, dtype=torch.float32,
                    device=torch.device("cpu"))  # fmt: skip
    table = shuffled_blocks(32, -(-len(ids) // 8), seed=3)
    return run_chunks(model, cache, ids, chunks, table)


def test_logits_match_transformers_on_both_sides_of_the_original_context(
    checkpoint: tuple[str, Path, Any],
) -> None:
    kind, folder, hf = checkpoint
    cfg = ModelConfig.from_pretrained(folder)
    model = load_model(folder, cfg, torch.device("cpu"), torch.float32)
    assert type(model) is Phi3ForCausalLM and model.rope is not None
    assert model.rope.rotary_dim == 12 and cfg.head_dim == 16
    rng = random.Random(1)
    long_ids = [rng.randrange(cfg.vocab_size) for _ in range(90)]  # past the original 32
    short_ids = long_ids[:30]
    # the default context (128) takes the long factors: transformers' past 32 tokens
    ours = _logits(model, cfg, long_ids, [37, 3, 40, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    ref = hf_logits(hf, long_ids)
    assert ref.std().item() > 0.05
    assert (ours - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
    short_ref = hf_logits(hf, short_ids)
    if kind == "phi3-longrope":  # the two lists differ: a 30-token sequence tells them apart
        assert model.rope.long_factors
        ours = _logits(model, cfg, short_ids, [17, 13])
        assert (ours - short_ref).abs().max().item() > 1e-2
        model.init_rope(torch.device("cpu"), ORIGINAL)  # serving 32 tokens: the short list
        assert not model.rope.long_factors
    ours = _logits(model, cfg, short_ids, [17, 1, 12])
    assert (ours - short_ref).abs().max().item() < 1e-4 * max(1.0, short_ref.abs().max().item())


def test_longrope_frequencies_are_transformers(tmp_path: Path) -> None:
    """Both factor lists and the cos/sin scale sqrt(1 + log(128 / 32) / log(32))."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = phi3_config("phi3-longrope")
    hf_cfg.save_pretrained(tmp_path)
    cfg = ModelConfig.from_pretrained(tmp_path)
    for seq_len, context in ((None, ORIGINAL), (ORIGINAL + 1, STRETCHED)):
        want, want_scale = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, None, seq_len=seq_len)
        got, scale = rope_inv_freq(cfg.rope, cfg.head_dim, context)
        torch.testing.assert_close(got, want.float(), rtol=0, atol=0)
        assert scale == pytest.approx(want_scale, rel=1e-12)
    assert scale == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))


# --- the engine's greedy tokens against transformers' generate -------------------------


def test_greedy_alone_batched_from_the_prefix_cache_and_chunked(
    checkpoint: tuple[str, Path, Any], prompts: list[list[int]]
) -> None:
    """Prompts 3 and 4 (45 and 60 tokens, sharing 40) are past the original context;
    for ``phi3-longrope`` they are the ones transformers runs with the long factors."""
    kind, folder, hf = checkpoint
    chosen = prompts if kind == "phi3" else [p for p in prompts if len(p) > ORIGINAL]
    assert len(chosen) >= 2
    refs = [Reference(hf, p) for p in chosen]
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", num_blocks=128))
    assert engine.runner.model.fused is None
    for i, prompt in enumerate(chosen):  # alone
        engine.reset_prefix_cache()
        (ours,) = run(engine, [prompt])
        refs[i].check(ours, f"{kind} prompt {i} alone")
    engine.reset_prefix_cache()
    for i, ours in enumerate(run(engine, chosen)):  # one batch
        refs[i].check(ours, f"{kind} prompt {i} batched")
    hits = engine.stats()["prefix_cache_hit_tokens"]
    for i, ours in enumerate(run(engine, chosen)):  # again: full blocks from the cache
        refs[i].check(ours, f"{kind} prompt {i} prefix-cached")
    assert engine.stats()["prefix_cache_hit_tokens"] >= hits + 32
    chunked = LLMEngine(
        EngineConfig(
            model=str(folder), device="cpu", num_blocks=14, block_size=16,
            max_num_batched_tokens=24, enable_prefix_caching=False,
        )
    )  # fmt: skip
    for i, ours in enumerate(run(chunked, chosen)):
        refs[i].check(ours, f"{kind} prompt {i} chunked/preempted")
    if kind == "phi3":
        assert chunked.stats()["preemptions"] > 0


def test_longrope_within_the_original_context_takes_the_short_factors(
    checkpoint: tuple[str, Path, Any], prompts: list[list[int]]
) -> None:
    """``max_model_len`` 32: every sequence fits the original context, as transformers'
    short-factor runs do; each stops at 32 tokens."""
    kind, folder, hf = checkpoint
    if kind != "phi3-longrope":
        pytest.skip("longrope only")
    short = [p for p in prompts if len(p) <= 16]
    engine = LLMEngine(
        EngineConfig(model=str(folder), device="cpu", num_blocks=64, max_model_len=ORIGINAL)
    )
    assert engine.runner.model.rope is not None and not engine.runner.model.rope.long_factors
    assert short
    for prompt, ours in zip(short, run(engine, short), strict=True):
        ref = Reference(hf, prompt)  # its first 32 - len(prompt) tokens: short factors
        assert len(ours) == ORIGINAL - len(prompt) < NEW_TOKENS
        pairs = zip(ours, ref.tokens[: len(ours)], strict=True)
        diffs = [i for i, (a, b) in enumerate(pairs) if a != b]
        if diffs:  # only where transformers' two best tie
            top = ref.logits[diffs[0]].topk(2)
            assert float(top.values[0] - top.values[1]) < TIE_GAP, (len(prompt), diffs)


# --- configs ---------------------------------------------------------------------------


def test_phi3_config_fields(tmp_path: Path) -> None:
    phi3_config("phi3-longrope").save_pretrained(tmp_path)
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert model_class(cfg) is Phi3ForCausalLM
    rope = cfg.rope
    assert (rope.rope_type, rope.partial_rotary_factor, rope.factor) == ("longrope", 0.75, 4.0)
    assert rope.original_max_position_embeddings == ORIGINAL
    assert rope.short_factor == tuple(SHORT) and rope.long_factor == tuple(LONG)


def _raw(**rope: Any) -> dict[str, Any]:
    return {
        "model_type": "phi3", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "original_max_position_embeddings": 32,
        "partial_rotary_factor": 0.75, "rope_scaling": rope,
    }  # fmt: skip


def test_su_is_longrope_and_bad_factors_are_one_line() -> None:
    su = ModelConfig.from_dict(_raw(type="su", short_factor=SHORT, long_factor=LONG))
    assert su.rope.rope_type == "longrope" and su.rope.factor == 4.0
    with pytest.raises(ValueError, match=r"^rope_scaling\.long_factor: expected 6 positive"):
        ModelConfig.from_dict(_raw(type="longrope", short_factor=SHORT, long_factor=LONG[:5]))
    with pytest.raises(ValueError, match=r"^rope_scaling\.short_factor: "):
        ModelConfig.from_dict(_raw(type="longrope", long_factor=LONG))
    odd = {**_raw(), "partial_rotary_factor": 0.4375}  # 7 of 16 values: no pairs
    with pytest.raises(ValueError, match=r"^partial_rotary_factor: 0\.4375 of head_dim 16 "):
        ModelConfig.from_dict(odd)


def test_partial_rotary_applies_to_every_family(tmp_path: Path, model_path: Path) -> None:
    """A Llama checkpoint with ``partial_rotary_factor`` 0.5 against transformers."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    hf_cfg = LlamaConfig(**TINY, partial_rotary_factor=0.5, tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    randomize(hf)
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_pretrained(tmp_path)
    model = load_model(tmp_path, cfg, torch.device("cpu"), torch.float32)
    assert model.rope is not None and model.rope.rotary_dim == 8
    ids = [random.Random(2).randrange(cfg.vocab_size) for _ in range(40)]
    ref = hf_logits(hf, ids)
    ours = _logits(model, cfg, ids, [20, 19, 1])
    assert (ours - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
    assert not model.fuse()  # the fused decoder rotates whole heads only
