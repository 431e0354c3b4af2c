"""Mistral's, Qwen2's and Qwen3's ``sliding_window``, read and applied as transformers does.

Two tiny random checkpoints, as tests/engine/models/test_families.py builds the other
families (2 layers, GQA, the default model's tokenizer and vocabulary), with a window of
8 tokens (shorter than four of the five prompts and than every generation): a Mistral
(every layer slides) and a Qwen2 with ``use_sliding_window`` and ``max_window_layers`` 1
(a global layer, then a windowed one). Our logits through the paged cache match
transformers', and the same checkpoints without their windows give other logits past the
window (so no test here passes by ignoring it); the engine's greedy tokens equal
transformers' greedy ``generate``, alone, batched, from the prefix cache, and chunked
with preemption. A query sees its last ``sliding_window`` keys (transformers' mask: key
``k`` for query ``q`` where ``q - window < k <= q``). ``ModelConfig`` gives each layer
the window transformers' configs derive: every layer for Mistral, the layers from
``max_window_layers`` on (or those ``layer_types`` names) for Qwen2 / Qwen3 with
``use_sliding_window``, none for Llama.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.models.test_families import TINY, Reference, prompts, randomize, run
from tests.engine.models.test_llama import hf_logits, run_chunks, shuffled_blocks
from tokenrelay.engine import EngineConfig, LLMEngine
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.weights import load_model
from tokenrelay.engine.runner.kv_cache import KVCache

__all__ = ["prompts"]  # the shared prompts fixture (five prompts, 5 to 93 tokens)

CPU = torch.device("cpu")
WINDOW = 8
WINDOWS = {"mistral": (WINDOW, WINDOW), "qwen2": (None, WINDOW)}  # each layer's window


def build_windowed(kind: str, folder: Path, tokenizer_dir: Path) -> Any:
    """Save a random windowed ``kind`` checkpoint and the default tokenizer in ``folder``;
    the transformers model."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    if kind == "mistral":
        config = MistralConfig(**TINY, sliding_window=WINDOW, tie_word_embeddings=False)
    else:  # the layers from max_window_layers on slide: the second only
        config = Qwen2Config(
            **TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
            tie_word_embeddings=False,
        )  # fmt: skip
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).float().eval()
    randomize(hf)
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return hf


@pytest.fixture(scope="module", params=list(WINDOWS))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_path: Path
) -> tuple[str, Path, Any]:
    """``(kind, checkpoint folder, transformers model)``."""
    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    return kind, folder, build_windowed(kind, folder, model_path)


def paged_logits(folder: Path, cfg: ModelConfig, ids: list[int]) -> torch.Tensor:
    """Our logits of every position of ``ids``, fed through the paged cache in chunks."""
    model = load_model(folder, cfg, CPU, torch.float32)
    cache = KVCache(cfg, num_blocks=16, block_size=8, dtype=torch.float32, device=CPU)
    table = shuffled_blocks(16, -(-len(ids) // 8), seed=3)
    return run_chunks(model, cache, ids, [5, 14, 1, 20, 1, 1, 1, 1], table)


def test_logits_match_transformers_and_differ_without_the_window(
    checkpoint: tuple[str, Path, Any],
) -> None:
    kind, folder, hf = checkpoint
    cfg = ModelConfig.from_pretrained(folder)
    assert cfg.layer_windows == WINDOWS[kind]
    rng = random.Random(2)  # one generator: 44 different ids
    ids = [rng.randrange(cfg.vocab_size) for _ in range(44)]
    ours = paged_logits(folder, cfg, ids)
    ref = hf_logits(hf, ids)
    assert ref.std().item() > 0.05  # not trivially between near-zeros
    assert (ours - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
    full = paged_logits(folder, dataclasses.replace(cfg, layer_windows=()), ids)
    # the first WINDOW positions see every key either way; each later one does not
    torch.testing.assert_close(ours[:WINDOW], full[:WINDOW], rtol=1e-5, atol=1e-5)
    assert (ours[WINDOW:] - full[WINDOW:]).abs().amax(-1).min().item() > 1e-3


def test_greedy_alone_batched_from_the_prefix_cache_and_chunked(
    checkpoint: tuple[str, Path, Any], prompts: list[list[int]]
) -> None:
    kind, folder, hf = checkpoint
    refs = [Reference(hf, p) for p in prompts]
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", num_blocks=128))
    for i, prompt in enumerate(prompts):  # alone
        engine.reset_prefix_cache()
        (ours,) = run(engine, [prompt])
        refs[i].check(ours, f"{kind} prompt {i} alone")
    engine.reset_prefix_cache()
    for i, ours in enumerate(run(engine, prompts)):  # one batch (the shared prefix too)
        refs[i].check(ours, f"{kind} prompt {i} batched")
    hits = engine.stats()["prefix_cache_hit_tokens"]
    for i, ours in enumerate(run(engine, prompts)):  # again: full blocks from the cache
        refs[i].check(ours, f"{kind} prompt {i} prefix-cached")
    assert engine.stats()["prefix_cache_hit_tokens"] >= hits + 96
    chunked = LLMEngine(  # a 24-token step budget, 14 blocks of 16 for a batch needing 26
        EngineConfig(
            model=str(folder), device="cpu", num_blocks=14, block_size=16,
            max_num_batched_tokens=24, enable_prefix_caching=False,
        )
    )  # fmt: skip
    for i, ours in enumerate(run(chunked, prompts)):
        refs[i].check(ours, f"{kind} prompt {i} chunked/preempted")
    assert chunked.stats()["preemptions"] > 0


# --- configs ---------------------------------------------------------------------------


def _hf(cls_name: str, **fields: Any) -> Any:
    import transformers

    base = dict(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    return getattr(transformers, cls_name)(**base, **fields)


@pytest.mark.parametrize("cls_name", ["Qwen2Config", "Qwen3Config"])
@pytest.mark.parametrize("use", [False, True])
@pytest.mark.parametrize("first", [0, 2, 6, 28])
def test_qwen_windows_are_the_layer_types_transformers_derives(
    cls_name: str, use: bool, first: int
) -> None:
    """With or without ``layer_types`` in config.json (transformers 5 writes it; older
    checkpoints have ``max_window_layers`` only), the same windows."""
    hf = _hf(cls_name, use_sliding_window=use, sliding_window=16, max_window_layers=first)
    want = tuple(16 if t == "sliding_attention" else None for t in hf.layer_types)
    want = want if any(want) else ()
    written = hf.to_dict()
    assert ModelConfig.from_dict(written).layer_windows == want
    written.pop("layer_types")
    assert ModelConfig.from_dict(written).layer_windows == want
    assert want == (() if not use or first >= 6 else (None,) * first + (16,) * (6 - first))


def test_mistral_slides_every_layer_and_llama_none() -> None:
    mistral = _hf("MistralConfig", sliding_window=16).to_dict()
    assert ModelConfig.from_dict(mistral).layer_windows == (16,) * 6
    for unset in (None, 0):  # Mistral v0.2+: null
        assert ModelConfig.from_dict({**mistral, "sliding_window": unset}).layer_windows == ()
    # transformers' Mistral ignores layer_types (it warns): every layer still slides
    typed = {**mistral, "layer_types": ["full_attention"] * 6}
    assert ModelConfig.from_dict(typed).layer_windows == (16,) * 6
    llama = {**_hf("LlamaConfig").to_dict(), "sliding_window": 16}
    assert ModelConfig.from_dict(llama).layer_windows == ()


def test_a_window_as_long_as_the_context_is_left_out() -> None:
    """No position below ``max_position_embeddings`` can look past such a window."""
    for cfg in (
        _hf("MistralConfig", sliding_window=1024).to_dict(),
        _hf("Qwen2Config", use_sliding_window=True, sliding_window=4096).to_dict(),
        _hf("Phi3Config", sliding_window=2048).to_dict(),  # Phi-3-mini-128k's kind
    ):
        assert ModelConfig.from_dict(cfg).layer_windows == ()
    for name in ("MistralConfig", "Phi3Config"):
        short = _hf(name, sliding_window=1023).to_dict()
        assert ModelConfig.from_dict(short).layer_windows == (1023,) * 6


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"sliding_window": -4}, "sliding_window"),
        ({"max_window_layers": -1, "layer_types": None}, "max_window_layers"),
        ({"layer_types": ["sliding_attention"] * 5}, "layer_types"),
        ({"layer_types": ["local"] * 6}, "layer_types"),
    ],
)
def test_bad_window_fields_are_one_line(overrides: dict[str, Any], field: str) -> None:
    cfg = {**_hf("Qwen2Config", use_sliding_window=True, sliding_window=16).to_dict()}
    cfg.update(overrides)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ValueError, match=rf"^{field}: [^\n]*$"):
        ModelConfig.from_dict(cfg)
