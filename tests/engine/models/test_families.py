"""Granite and OLMo 2 from Hugging Face folders, against transformers on random weights.

Each family's checkpoint is built here from a tiny transformers config (2 layers, GQA,
the default model's tokenizer and vocabulary), with random weights, and saved with
``save_pretrained``. Our logits must match transformers' through the paged cache;
our engine's greedy tokens must equal transformers' greedy ``generate``, alone and
batched, with prefix-cache hits, with chunked prefill and with preemption. A first
divergence is allowed only where transformers' top-2 logits are within 1e-4 and our
token is one of them; it is reported as a warning.
"""

from __future__ import annotations

import copy
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.models.test_llama import PROMPTS, hf_logits, run_chunks, shuffled_blocks
from tokenrelay.engine import EngineConfig, LLMEngine, SamplingParams
from tokenrelay.engine.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from tokenrelay.engine.models.families import FAMILIES, model_class
from tokenrelay.engine.models.granite import GraniteForCausalLM
from tokenrelay.engine.models.olmo2 import Olmo2ForCausalLM
from tokenrelay.engine.models.weights import load_model
from tokenrelay.engine.runner.kv_cache import KVCache

NEW_TOKENS = 32
TIE_GAP = 1e-4  # transformers' top-2 logits closer than this: either token is right
TINY: dict[str, Any] = dict(
    vocab_size=49152,  # the default model's tokenizer
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Granite 3.x's multipliers (granite-3.x-2b's), the attention one not 1 / sqrt(head_dim)
GRANITE = dict(
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    attention_multiplier=0.1,
    logits_scaling=8.0,
)
FAMILY_NAMES = ["granite-bias", "olmo2"]  # the engine tests: varied greedy tokens


def hf_config(kind: str) -> Any:
    from transformers import GraniteConfig, Olmo2Config

    if kind == "granite":  # as Granite 3.x: tied, no biases
        return GraniteConfig(**TINY, **GRANITE, tie_word_embeddings=True)
    if kind == "granite-bias":  # untied (a tied tiny random model repeats its input token)
        return GraniteConfig(
            **TINY, **GRANITE, tie_word_embeddings=False, attention_bias=True, mlp_bias=True
        )
    if kind == "olmo2":
        return Olmo2Config(**TINY, tie_word_embeddings=False, rms_norm_eps=1e-6)
    raise AssertionError(kind)


def randomize(model: Any, seed: int = 0) -> None:
    """Weights far from transformers' tiny init: norms around 1, the rest ~0.1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.1 * noise)


def build_checkpoint(kind: str, folder: Path, tokenizer_dir: Path) -> Any:
    """Save a random ``kind`` checkpoint and the default tokenizer in ``folder``; the model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config(kind)).float().eval()
    randomize(hf)
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return hf


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_path: Path
) -> tuple[str, Path, Any]:
    """``(kind, checkpoint folder, transformers model)`` of one family."""
    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    return kind, folder, build_checkpoint(kind, folder, model_path)


@pytest.fixture(scope="module")
def prompts(default_tokenizer: Any) -> list[list[int]]:
    """Five prompts of 5 to 93 tokens; the last two share a 40-token prefix."""
    ids = [list(default_tokenizer(p)["input_ids"]) for p in PROMPTS]
    shared = ids[3][:40]
    return [*ids[:3], shared + ids[0], shared + ids[1][:20]]


@pytest.fixture(scope="module")
def references(family: tuple[str, Path, Any], prompts: list[list[int]]) -> list[Reference]:
    return [Reference(family[2], p) for p in prompts]


class Reference:
    """transformers' greedy tokens of one prompt, alone, and its logits at every step."""

    def __init__(self, hf: Any, prompt: list[int]) -> None:
        config = copy.deepcopy(hf.generation_config)
        config.do_sample, config.max_new_tokens = False, NEW_TOKENS
        config.eos_token_id, config.pad_token_id = [], 0  # generate through EOS
        config.output_logits = config.return_dict_in_generate = True
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                generation_config=config,
            )
        self.tokens: list[int] = out.sequences[0, len(prompt) :].tolist()
        self.logits = [step[0].float() for step in out.logits]  # NEW_TOKENS x [V]

    def check(self, ours: list[int], label: str) -> None:
        """``ours`` equals these tokens, or first differs at a top-2 tie (reported)."""
        assert len(ours) == NEW_TOKENS
        diffs = [i for i, (a, b) in enumerate(zip(ours, self.tokens, strict=True)) if a != b]
        if not diffs:
            return
        i = diffs[0]
        top = self.logits[i].topk(2)
        gap = float(top.values[0] - top.values[1])
        assert gap < TIE_GAP and ours[i] in top.indices.tolist(), (
            f"{label}: token {i} is {ours[i]}, transformers' {self.tokens[i]} (top-2 gap {gap:.3g})"
        )
        warnings.warn(f"{label}: first divergence at token {i}, top-2 gap {gap:.3g}", stacklevel=2)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Add every prompt at once and step until all finish; token ids per prompt."""
    ids = [f"family-{id(prompts)}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, GREEDY)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[rid] for rid in ids]


# --- the model against transformers' forward -------------------------------------------


@pytest.mark.parametrize("kind", ["granite", "granite-bias", "olmo2"])
def test_logits_match_transformers_through_the_paged_cache(
    tmp_path: Path, model_path: Path, kind: str
) -> None:
    hf = build_checkpoint(kind, tmp_path, model_path)
    cfg = ModelConfig.from_pretrained(tmp_path)
    model = load_model(tmp_path, cfg, torch.device("cpu"), torch.float32)
    assert type(model) is FAMILIES[cfg.model_type]
    cpu = torch.device("cpu")
    cache = KVCache(cfg, num_blocks=32, block_size=8, dtype=torch.float32, device=cpu)
    rng = random.Random(1)  # one generator: 90 different ids
    ids = [rng.randrange(cfg.vocab_size) for _ in range(90)]
    table = shuffled_blocks(32, -(-len(ids) // 8), seed=3)
    ours = run_chunks(model, cache, ids, [37, 3, 40, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], table)
    ref = hf_logits(hf, ids)
    assert ref.std().item() > 0.05  # not trivially between near-zeros
    assert (ours - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


# --- the engine's greedy tokens against transformers' generate -------------------------


def test_greedy_alone_batched_and_from_the_prefix_cache(
    family: tuple[str, Path, Any], prompts: list[list[int]], references: list[Reference]
) -> None:
    kind, folder, _ = family
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", num_blocks=128))
    assert engine.runner.model.fused is None
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
    """A 24-token step budget (every longer prompt is prefilled in chunks) and a pool of 14
    blocks of 16 for a batch that needs 26 at once (sequences are preempted)."""
    kind, folder, _ = family
    engine = LLMEngine(
        EngineConfig(
            model=str(folder), device="cpu", num_blocks=14, block_size=16,
            max_num_batched_tokens=24, enable_prefix_caching=False,
        )
    )  # fmt: skip
    assert max(map(len, prompts)) > 24
    for i, ours in enumerate(run(engine, prompts)):
        references[i].check(ours, f"{kind} prompt {i} chunked/preempted")
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["blocks_free"] == stats["blocks_total"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_variants_are_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    """Llama's norm scales the cast value, OLMo's casts the fp32 product."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from tokenrelay.engine.models.blocks import RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(7, 48, generator=gen)).to(dtype)
    weight = (1 + 0.3 * torch.randn(48, generator=gen)).to(dtype)
    for ref_cls, fp32_scale in ((LlamaRMSNorm, False), (Olmo2RMSNorm, True)):
        ours, ref = RMSNorm(48, 1e-6, scale_in_fp32=fp32_scale), ref_cls(48, eps=1e-6)
        with torch.no_grad():
            ours.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
            ref.weight.copy_(weight)
            got, want = ours(x), ref.to(dtype)(x)
        assert got.dtype == want.dtype == dtype
        if dtype == torch.float32:  # F.rms_norm: the same formula, another summation order
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, want), ref_cls.__name__


# --- configs, the family table, the fused decoder -------------------------------------


def test_every_supported_model_type_has_a_family() -> None:
    assert set(FAMILIES) == set(SUPPORTED_MODEL_TYPES)
    assert {"granite", "olmo2"} <= set(SUPPORTED_MODEL_TYPES)


def test_family_configs_read_their_fields(tmp_path: Path) -> None:
    hf_config("granite").save_pretrained(tmp_path / "g")
    hf_config("olmo2").save_pretrained(tmp_path / "o")
    granite = ModelConfig.from_pretrained(tmp_path / "g")
    assert (granite.embedding_multiplier, granite.residual_multiplier) == (12.0, 0.22)
    assert granite.attention_scale == 0.1 and granite.logits_scaling == 8.0
    assert granite.tie_word_embeddings and not granite.qk_norm_full
    olmo = ModelConfig.from_pretrained(tmp_path / "o")
    assert olmo.qk_norm_full and not olmo.qk_norm
    assert olmo.attention_scale == olmo.head_dim**-0.5 and olmo.logits_scaling == 1.0
    assert model_class(granite) is GraniteForCausalLM and model_class(olmo) is Olmo2ForCausalLM


def _base(**overrides: Any) -> dict[str, Any]:
    cfg = {
        "model_type": "granite",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    cfg.update(overrides)
    return cfg


def test_granite_defaults_are_transformers() -> None:
    cfg = ModelConfig.from_dict(_base())
    assert cfg.attention_scale == 1.0  # GraniteConfig's default multiplier, not 1/sqrt(d)
    assert cfg.embedding_multiplier == cfg.residual_multiplier == cfg.logits_scaling == 1.0


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"logits_scaling": 0}, "logits_scaling"),
        ({"attention_multiplier": "0.1"}, "attention_multiplier"),
        ({"embedding_multiplier": float("nan")}, "embedding_multiplier"),
        ({"residual_multiplier": -0.2}, "residual_multiplier"),
        ({"model_type": "olmo2", "rms_norm_eps": 0}, "rms_norm_eps"),
    ],
)
def test_family_fields_are_checked(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        ModelConfig.from_dict(_base(**overrides))


def test_an_unknown_model_type_is_one_line_naming_the_families() -> None:
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(_base(model_type="gemma"))
    message = str(err.value)
    assert "\n" not in message and "'gemma' is not supported" in message
    assert message.endswith(f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
