"""Gemma 2 and Gemma 3 (text) from Hugging Face folders, against transformers on random
weights, with a sliding window shorter than the prompts.

Each checkpoint is built here from a tiny transformers config (3 layers: local, global,
local; a window of 8 tokens; GQA; the default model's tokenizer and vocabulary), with
random weights, saved with ``save_pretrained``; transformers runs it with its eager
attention. Our logits must match through the paged cache, and our engine's greedy tokens
transformers' greedy ``generate``, alone and batched, with prefix-cache hits, with chunked
prefill and preemption, and (Gemma 2) on the Triton backend under its interpreter. A
first divergence is allowed only at a top-2 tie, as in ``test_families.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.models.test_families import TINY, Reference, randomize, run
from tests.engine.models.test_llama import PROMPTS, hf_logits, run_chunks, shuffled_blocks
from tokenrelay.engine import EngineConfig, LLMEngine
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.families import model_class
from tokenrelay.engine.models.gemma import GemmaForCausalLM
from tokenrelay.engine.models.weights import load_model
from tokenrelay.engine.runner.kv_cache import KVCache

if not torch.cuda.is_available():  # the Triton kernels run under Triton's CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

WINDOW = 8
CPU = torch.device("cpu")
# 3 layers (local, global, local), head_dim 16 with a softmax scale of 24 ** -0.5
GEMMA: dict[str, Any] = dict(
    TINY, num_hidden_layers=3, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24
)


def hf_config(kind: str) -> Any:
    from transformers import Gemma2Config, Gemma3TextConfig

    if kind == "gemma2":  # soft-caps low enough to bend these random scores and logits
        return Gemma2Config(
            **GEMMA, tie_word_embeddings=False, attn_logit_softcapping=3.0,
            final_logit_softcapping=8.0,
        )  # fmt: skip
    if kind.startswith("gemma3"):  # local layers at base 100, global 10^4 with linear x4
        return Gemma3TextConfig(
            **GEMMA, tie_word_embeddings=kind == "gemma3-tied", sliding_window_pattern=2,
            rope_local_base_freq=100.0, rope_theta=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        )  # fmt: skip
    raise AssertionError(kind)


def build_checkpoint(kind: str, folder: Path, tokenizer_dir: Path) -> Any:
    """Save a random ``kind`` checkpoint and the default tokenizer in ``folder``; the
    transformers model (eager attention: the reference for windows and soft-caps)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = hf_config(kind)
    config._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomize(hf)
    with torch.no_grad():  # Gemma's norms scale by 1 + weight: weights around 0, not 1
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.sub_(1.0)
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return hf


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_path: Path
) -> tuple[str, Path, Any]:
    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    return kind, folder, build_checkpoint(kind, folder, model_path)


@pytest.fixture(scope="module")
def prompts(default_tokenizer: Any) -> list[list[int]]:
    """Five prompts of 5 to 93 tokens (all but the first longer than the window); the last
    two share a 40-token prefix."""
    ids = [list(default_tokenizer(p)["input_ids"]) for p in PROMPTS]
    shared = ids[3][:40]
    return [*ids[:3], shared + ids[0], shared + ids[1][:20]]


@pytest.fixture(scope="module")
def references(family: tuple[str, Path, Any], prompts: list[list[int]]) -> list[Reference]:
    return [Reference(family[2], p) for p in prompts]


def ours_logits(folder: Path, ids: list[int], cfg: ModelConfig | None = None) -> torch.Tensor:
    """Our logits of every position, fed through the paged cache in uneven chunks."""
    cfg = cfg or ModelConfig.from_pretrained(folder)
    model = load_model(folder, cfg, CPU, torch.float32)
    assert type(model) is GemmaForCausalLM
    cache = KVCache(cfg, num_blocks=32, block_size=8, dtype=torch.float32, device=CPU)
    table = shuffled_blocks(32, -(-len(ids) // 8), seed=3)
    return run_chunks(model, cache, ids, [37, 3, 40, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], table)


# --- the model against transformers' forward -------------------------------------------


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "gemma3-tied"])
def test_logits_match_transformers_through_the_paged_cache(
    tmp_path: Path, model_path: Path, kind: str
) -> None:
    hf = build_checkpoint(kind, tmp_path, model_path)
    rng = random.Random(1)
    ids = [rng.randrange(TINY["vocab_size"]) for _ in range(90)]
    ours, ref = ours_logits(tmp_path, ids), hf_logits(hf, ids)
    assert ref.std().item() > 0.05  # not trivially between near-zeros
    assert (ours - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
    if kind == "gemma2":  # the caps bite: no logit reaches the final one
        assert 4.0 < ref.abs().max().item() < 8.0


def test_the_window_and_the_local_rope_change_the_logits(tmp_path: Path, model_path: Path) -> None:
    """The same Gemma 3 checkpoint with windows longer than the prompt, or one RoPE for
    every layer: other logits past the window (so the tests above do check them)."""
    build_checkpoint("gemma3", tmp_path, model_path)
    rng = random.Random(2)
    ids = [rng.randrange(TINY["vocab_size"]) for _ in range(90)]
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.layer_windows == (WINDOW, None, WINDOW) and cfg.local_rope is not None
    ours = ours_logits(tmp_path, ids, cfg)
    for changed in (
        dataclasses.replace(cfg, layer_windows=(1000, None, 1000)),
        dataclasses.replace(cfg, local_rope=None),
    ):
        other = ours_logits(tmp_path, ids, changed)
        if changed.local_rope is not None:  # within the window, a window changes nothing
            torch.testing.assert_close(ours[:WINDOW], other[:WINDOW], rtol=1e-5, atol=1e-5)
        assert (ours[WINDOW:] - other[WINDOW:]).abs().max().item() > 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_offset_norm_is_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from tokenrelay.engine.models.blocks import OffsetRMSNorm

    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(7, 48, generator=gen)).to(dtype)
    weight = (0.3 * torch.randn(48, generator=gen)).to(dtype)
    ours, ref = OffsetRMSNorm(48, 1e-6), Gemma2RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        ours.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        ref.weight.copy_(weight)
        got, want = ours(x), ref.to(dtype)(x)
    assert got.dtype == want.dtype == dtype
    if dtype == torch.float32:  # F.rms_norm: the same formula, another summation order
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_embeddings_scale_by_sqrt_hidden_rounded_as_transformers(dtype: torch.dtype) -> None:
    """sqrt(48) = 6.93 is 6.94 in bf16: the rows are scaled by the rounded value, bit for
    bit as transformers' ``Gemma2TextScaledWordEmbedding``."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

    cfg = ModelConfig.from_dict(_base("gemma2", hidden_size=48))
    with torch.device("meta"):
        model = GemmaForCausalLM(cfg)
    weight = torch.randn(100, 48, generator=torch.Generator().manual_seed(0)).to(dtype)
    model.embed = torch.nn.Parameter(weight, requires_grad=False)
    ref = Gemma2TextScaledWordEmbedding(100, 48, 0, embed_scale=48**0.5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(weight)
        ids = torch.tensor([3, 0, 99, 3, 41])
        got, want = model.embed_tokens(ids), ref(ids)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)


# --- the engine's greedy tokens against transformers' generate -------------------------


def test_greedy_alone_batched_and_from_the_prefix_cache(
    family: tuple[str, Path, Any], prompts: list[list[int]], references: list[Reference]
) -> None:
    kind, folder, _ = family
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", num_blocks=128))
    assert engine.runner.model.fused is None
    assert engine.runner.attention_backend == "cpu"  # decode rows in the C kernel
    for i, prompt in enumerate(prompts):  # alone
        engine.reset_prefix_cache()
        (ours,) = run(engine, [prompt])
        references[i].check(ours, f"{kind} prompt {i} alone")
    engine.reset_prefix_cache()
    for i, ours in enumerate(run(engine, prompts)):  # one batch (the shared prefix too)
        references[i].check(ours, f"{kind} prompt {i} batched")
    hits = engine.stats()["prefix_cache_hit_tokens"]
    for i, ours in enumerate(run(engine, prompts)):  # again: full blocks from the cache
        references[i].check(ours, f"{kind} prompt {i} prefix-cached")
    assert engine.stats()["prefix_cache_hit_tokens"] >= hits + 96
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0


def test_greedy_with_chunked_prefill_and_preemption(
    family: tuple[str, Path, Any], prompts: list[list[int]], references: list[Reference]
) -> None:
    """A 24-token step budget (longer prompts prefill in chunks, across the window) and a
    pool of 14 blocks of 16 for a batch that needs 26 at once (sequences are preempted)."""
    kind, folder, _ = family
    engine = LLMEngine(
        EngineConfig(
            model=str(folder), device="cpu", num_blocks=14, block_size=16,
            max_num_batched_tokens=24, enable_prefix_caching=False,
        )
    )  # fmt: skip
    for i, ours in enumerate(run(engine, prompts)):
        references[i].check(ours, f"{kind} prompt {i} chunked/preempted")
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["blocks_free"] == stats["blocks_total"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")
@pytest.mark.parametrize("family", ["gemma2"], indirect=True)  # windows and soft-caps
def test_greedy_on_the_triton_backend(
    family: tuple[str, Path, Any], prompts: list[list[int]], references: list[Reference]
) -> None:
    """The Triton kernels (the interpreter on a CPU) with windows and (Gemma 2) soft-caps:
    two prompts in one batch, chunked, the second's prefix from the first's blocks."""
    kind, folder, _ = family
    engine = LLMEngine(
        EngineConfig(
            model=str(folder), device="cpu", attention_backend="triton", num_blocks=64,
            block_size=16, max_num_batched_tokens=48,
        )
    )  # fmt: skip
    assert engine.runner.attention_backend == "triton"
    for i, ours in zip((3, 4), run(engine, [prompts[3], prompts[4]]), strict=True):
        references[i].check(ours, f"{kind} prompt {i} triton")
    assert engine.stats()["prefix_cache_hit_tokens"] >= 32


# --- configs ---------------------------------------------------------------------------


def test_configs_read_their_fields(tmp_path: Path) -> None:
    hf_config("gemma2").save_pretrained(tmp_path / "g2")
    hf_config("gemma3-tied").save_pretrained(tmp_path / "g3")
    g2 = ModelConfig.from_pretrained(tmp_path / "g2")
    assert g2.layer_windows == (WINDOW, None, WINDOW) and g2.local_rope is None
    assert (g2.attn_softcap, g2.final_softcap) == (3.0, 8.0) and not g2.qk_norm
    assert g2.attention_scale == 24**-0.5 and not g2.tie_word_embeddings
    g3 = ModelConfig.from_pretrained(tmp_path / "g3")
    assert g3.layer_windows == (WINDOW, None, WINDOW) and g3.qk_norm and g3.tie_word_embeddings
    assert g3.attn_softcap is None and g3.final_softcap is None
    assert (g3.rope.theta, g3.rope.rope_type, g3.rope.factor) == (10000.0, "linear", 4.0)
    assert g3.local_rope is not None
    assert (g3.local_rope.theta, g3.local_rope.rope_type) == (100.0, "default")
    assert model_class(g2) is model_class(g3) is GemmaForCausalLM


def _base(model_type: str, **overrides: Any) -> dict[str, Any]:
    cfg = {
        "model_type": model_type,
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
    }
    cfg.update(overrides)
    return cfg


def test_older_configs_and_transformers_defaults() -> None:
    """Hub configs from before transformers 5: no ``layer_types`` (Gemma 2 alternates,
    Gemma 3 has every ``sliding_window_pattern``-th layer global), Gemma 3's
    ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``; absent fields take
    transformers' defaults (Gemma 2's caps 50 and 30, a window of 4096, scale 256^-0.5)."""
    g2 = ModelConfig.from_dict(_base("gemma2", hidden_act="gelu_pytorch_tanh"))
    assert g2.layer_windows == (4096, None) * 3 and g2.tie_word_embeddings
    assert (g2.attn_softcap, g2.final_softcap, g2.attention_scale) == (50.0, 30.0, 1 / 16)
    g3 = ModelConfig.from_dict(_base(
        "gemma3_text", sliding_window=512, sliding_window_pattern=3, rope_theta=1e6,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_base_freq=1e4,
    ))  # fmt: skip
    assert g3.layer_windows == (512, 512, None) * 2
    assert (g3.rope.theta, g3.rope.factor) == (1e6, 8.0) and g3.local_rope is not None
    assert (g3.local_rope.theta, g3.local_rope.factor) == (1e4, 1.0)
    assert g3.final_softcap is None and g3.attn_softcap is None
    default = ModelConfig.from_dict(_base("gemma3_text", final_logit_softcapping=None))
    assert default.layer_windows == (4096,) * 5 + (None,) and default.final_softcap is None
    assert default.local_rope is not None and default.rope.theta == 1e6
    assert default.local_rope.theta == 1e4


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["full_attention"] * 5}, "layer_types"),
        ({"layer_types": ["local"] * 6}, "layer_types"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"final_logit_softcapping": 0}, "final_logit_softcapping"),
        ({"query_pre_attn_scalar": -1}, "query_pre_attn_scalar"),
        ({"rope_parameters": {"full_attention": {"rope_type": "dynamic"}}}, "rope_scaling"),
    ],
)
def test_fields_gemma_cannot_honour_are_refused(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}[.:]"):
        ModelConfig.from_dict(_base("gemma3_text", **overrides))


def test_per_layer_type_rope_parameters_stay_refused_elsewhere(tmp_path: Path) -> None:
    cfg = _base("llama", rope_parameters={"full_attention": {"rope_theta": 1e4}})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"^rope_parameters: per-layer-type"):
        ModelConfig.from_pretrained(tmp_path)
