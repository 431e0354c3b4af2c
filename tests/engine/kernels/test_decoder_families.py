"""The fused decoder step on every family's layer, against that family's op-by-op decoder.

Each case is a tiny random model of one family (``model_class`` of its config) whose
projections are quantized, run through test_decoder.py's steps both ways: prefill
chunks on cached prefixes and decode rows in one batch, over scattered block tables.
The windows (4 and 6 tokens) are shorter than the sequences, so a step that ignored them
would differ; so would one that ignored any of the other settings, each checked by
turning it off in the fused step alone.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.engine.kernels.test_decoder import K_MIX, STEPS, quantized_model, run_steps
from tokenrelay.engine.kernels import decoder
from tokenrelay.engine.kernels.decoder_abi import REPACK_SWITCH
from tokenrelay.engine.models.config import ModelConfig, RopeConfig
from tokenrelay.engine.models.llama import CausalLM
from tokenrelay.engine.runner.kv_cache import KVCache

BASE = ModelConfig(
    model_type="llama", vocab_size=96, hidden_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=32, intermediate_size=160, rms_norm_eps=1e-6,
    rope=RopeConfig(theta=10000.0), max_position_embeddings=512, tie_word_embeddings=True,
)  # fmt: skip

CASES: dict[str, ModelConfig] = {
    # residual and attention multipliers, biases everywhere
    "granite": replace(
        BASE,
        model_type="granite",
        residual_multiplier=0.3,
        attention_multiplier=0.05,
        embedding_multiplier=4.0,
        logits_scaling=2.5,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
    ),
    # no input norms, norms after each sublayer, q/k norms over the whole projection
    "olmo2": replace(BASE, model_type="olmo2", qk_norm_full=True),
    # partial rotary, every layer windowed
    "phi3": replace(
        BASE,
        model_type="phi3",
        rope=RopeConfig(theta=10000.0, partial_rotary_factor=0.5),
        layer_windows=(6, 6),
    ),
    # 1 + w norms before and after both sublayers, GeGLU, soft-capped scores, a local layer
    "gemma2": replace(
        BASE,
        model_type="gemma2",
        attention_multiplier=0.2,
        attn_softcap=5.0,
        final_softcap=30.0,
        layer_windows=(4, None),
    ),
    # per-head q/k norms, the local layers' own RoPE base
    "gemma3_text": replace(
        BASE,
        model_type="gemma3_text",
        qk_norm=True,
        rope=RopeConfig(theta=1e6),
        local_rope=RopeConfig(theta=10.0),
        layer_windows=(4, None),
    ),
}


@pytest.fixture(autouse=True)
def _needs_the_library() -> None:
    if decoder.decoder_library() is None:
        pytest.skip("the fused decoder did not build here (no C compiler?)")


@pytest.fixture(autouse=True)
def _products_in_the_files_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both paths multiply Q4_K in the file's layout. The repacked kernel sums in another
    order (1e-5 apart): enough, in a few rows, to move an activation across a rounding
    boundary of a later product's int8 input, and the step then differs in that row and
    the rows attending to it. That kernel has its own tests (test_kquant.py, and fused in
    test_decoder.py); here only the layers' settings are compared."""
    monkeypatch.setenv(REPACK_SWITCH, "0")


def _family(name: str, qtype: str) -> CausalLM:
    cfg = CASES[name]
    if qtype == K_MIX:
        cfg = replace(cfg, hidden_size=256, intermediate_size=256, head_dim=64)
    model = quantized_model(cfg, qtype, seed=3)
    assert model.fuse() and model.fused is not None
    return model


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.allclose(g, w, rtol=1e-4, atol=1e-4) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("qtype", ["Q8_0", K_MIX])
@pytest.mark.parametrize("name", list(CASES))
def test_each_familys_fused_step_is_its_op_by_op_one(name: str, qtype: str) -> None:
    model = _family(name, qtype)
    want, want_kv = run_steps(model, False, STEPS)
    got, got_kv = run_steps(model, True, STEPS)
    for w, g in zip(want, got, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    # a sum order apart, an activation may round to the next step of the matmul's 8-bit
    # quantization of its input: a few K/V elements then differ by one step's share
    torch.testing.assert_close(got_kv, want_kv, rtol=2e-3, atol=2e-3)
    assert (~torch.isclose(got_kv, want_kv, rtol=1e-4, atol=1e-4)).float().mean() < 1e-3


# what each family's fused step would lose if one of its settings were dropped
SETTINGS = [
    ("granite", "shape", {"residual_scale": 1.0}),
    ("olmo2", "shape", {"qk_norm_whole": False}),
    ("gemma2", "shape", {"softcap": None}),
    ("gemma2", "shape", {"activation": "silu"}),
    ("phi3", "layer", {"window": None}),
    ("gemma2", "layer", {"window": None}),
    ("gemma3_text", "layer", {"local_rope": False}),
]


@pytest.mark.parametrize(("name", "where", "change"), SETTINGS)
def test_every_setting_matters(name: str, where: str, change: dict[str, object]) -> None:
    """The cases exercise what they claim: without the setting the step differs."""
    model = _family(name, "Q8_0")
    want, _ = run_steps(model, False, STEPS)
    layers = [layer.fused_weights() for layer in model.decoder_layers()]
    shape = model.fused_shape()
    if where == "shape":
        if change.get("qk_norm_whole") is False:  # per-head norms need [D] weights
            layers = [replace(lw, q_norm=None, k_norm=None) for lw in layers if lw]
        shape = replace(shape, **change)  # type: ignore[arg-type]
    else:
        layers = [replace(lw, **change) for lw in layers if lw]  # type: ignore[arg-type]
    library = decoder.decoder_library()
    assert library is not None and all(layers)
    model.fused = decoder.FusedDecoder(
        library,
        shape,
        layers,
        model.fused_norm(model.norm),  # type: ignore[arg-type]
    )
    got, _ = run_steps(model, True, STEPS)
    assert not _same(got, want)


def test_a_local_table_is_required_where_a_layer_rotates_locally() -> None:
    model = _family("gemma3_text", "Q8_0")
    fused = model.fused
    assert fused is not None and fused.local_rope
    fused.bind_cache(KVCache(model.cfg, 2, 4, torch.float32, torch.device("cpu")).data)
    x = torch.zeros(1, model.cfg.hidden_size)
    cs = torch.ones(1, model.cfg.head_dim // 2)
    one = torch.zeros(1, dtype=torch.int64)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="local"):
        fused.forward(x, cs, cs, one, tables, one, torch.ones(1, dtype=torch.int32))


def test_a_bad_rotary_dim_or_activation_is_refused() -> None:
    model = _family("phi3", "Q8_0")
    library = decoder.decoder_library()
    assert library is not None
    layers = [lw for layer in model.decoder_layers() if (lw := layer.fused_weights())]
    for bad in ({"rotary_dim": 7}, {"rotary_dim": 64}, {"activation": "relu"}):
        with pytest.raises(ValueError, match="rotary_dim"):
            decoder.FusedDecoder(
                library, replace(model.fused_shape(), **bad),  # type: ignore[arg-type]
                layers, model.norm.weight,
            )  # fmt: skip
