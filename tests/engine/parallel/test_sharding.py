"""The tensor-parallel split, checked on small random weights: no process group needed.

Column-parallel q/k/v and gate/up, row-parallel o and down, the KV heads each rank
keeps for its query heads, the vocabulary shards; and the sizes refused. Per family, as
a rank loads them: Phi-3's fused checkpoint tensors cut section by section, OLMo 2's
q/k norm weights cut with their heads (and a norm split over ranks is the whole one),
Gemma 3's per-head norms kept whole.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.engine.models import test_families, test_gemma, test_phi3
from tokenrelay.engine.config import EngineConfig
from tokenrelay.engine.models.blocks import OffsetRMSNorm, RMSNorm
from tokenrelay.engine.models.config import ModelConfig, RopeConfig
from tokenrelay.engine.models.llama import CausalLM
from tokenrelay.engine.models.weights import load_model
from tokenrelay.engine.parallel.layout import check_tensor_parallel, local_config, vocab_shard
from tokenrelay.engine.parallel.sharding import shard_state

SIZE = 3
CFG = ModelConfig(
    model_type="llama",
    vocab_size=10,  # not a multiple of 3: the last shard is padded
    hidden_size=12,
    num_layers=1,
    num_heads=6,
    num_kv_heads=3,
    head_dim=4,
    intermediate_size=9,
    rms_norm_eps=1e-6,
    rope=RopeConfig(),
    max_position_embeddings=64,
    tie_word_embeddings=True,
)


def _full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, hkv, d, e, i = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim, CFG.hidden_size, 9

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "embed": rnd(CFG.vocab_size, e),
        "norm.weight": rnd(e),
        "layers.0.input_norm.weight": rnd(e),
        "layers.0.attn.qkv_weight": rnd((h + 2 * hkv) * d, e),
        "layers.0.attn.qkv_bias": rnd((h + 2 * hkv) * d),
        "layers.0.attn.o_weight": rnd(e, h * d),
        "layers.0.attn.o_bias": rnd(e),
        "layers.0.mlp.gate_up_weight": rnd(2 * i, e),
        "layers.0.mlp.down_weight": rnd(e, i),
    }


def _shards() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    full = _full_state()
    return full, [shard_state(full, CFG, r, SIZE) for r in range(SIZE)]


def test_local_config_divides_heads_intermediate_and_vocab() -> None:
    local = local_config(CFG, SIZE)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 3)
    assert local.vocab_size == vocab_shard(10, 3) == 4
    assert local.head_dim == CFG.head_dim and local.num_kv_groups == CFG.num_kv_groups
    assert local_config(CFG, 1) is CFG


def test_qkv_is_column_parallel_with_each_ranks_own_kv_heads() -> None:
    full, shards = _shards()
    h, hkv, d = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
    x = torch.randn(5, CFG.hidden_size, dtype=torch.float64)
    y = x @ full["layers.0.attn.qkv_weight"].T + full["layers.0.attn.qkv_bias"]  # [5, (H+2Hkv)D]
    q, k, v = y.split([h * d, hkv * d, hkv * d], dim=1)
    q, k, v = q.view(5, h, d), k.view(5, hkv, d), v.view(5, hkv, d)
    lh, lkv = h // SIZE, hkv // SIZE
    for r, shard in enumerate(shards):
        part = x @ shard["layers.0.attn.qkv_weight"].T + shard["layers.0.attn.qkv_bias"]
        lq, lk, lv = part.split([lh * d, lkv * d, lkv * d], dim=1)
        heads = range(r * lh, (r + 1) * lh)
        kv_heads = range(r * lkv, (r + 1) * lkv)
        torch.testing.assert_close(lq.view(5, lh, d), q[:, heads.start : heads.stop])
        torch.testing.assert_close(lk.view(5, lkv, d), k[:, kv_heads.start : kv_heads.stop])
        torch.testing.assert_close(lv.view(5, lkv, d), v[:, kv_heads.start : kv_heads.stop])
        # GQA: every query head of this rank reads a KV head this rank holds
        assert {hq // CFG.num_kv_groups for hq in heads} <= set(kv_heads)


def test_o_and_down_are_row_parallel_summing_to_the_whole() -> None:
    full, shards = _shards()
    attn = torch.randn(5, CFG.num_heads * CFG.head_dim, dtype=torch.float64)
    act = torch.randn(5, CFG.intermediate_size, dtype=torch.float64)
    o_cols = CFG.num_heads * CFG.head_dim // SIZE
    i_cols = CFG.intermediate_size // SIZE
    o_sum = sum(
        attn[:, r * o_cols : (r + 1) * o_cols] @ s["layers.0.attn.o_weight"].T
        for r, s in enumerate(shards)
    )
    down_sum = sum(
        act[:, r * i_cols : (r + 1) * i_cols] @ s["layers.0.mlp.down_weight"].T
        for r, s in enumerate(shards)
    )
    torch.testing.assert_close(o_sum, attn @ full["layers.0.attn.o_weight"].T)
    torch.testing.assert_close(down_sum, act @ full["layers.0.mlp.down_weight"].T)
    for s in shards:  # added once, after the all-reduce: kept whole
        assert torch.equal(s["layers.0.attn.o_bias"], full["layers.0.attn.o_bias"])


def test_gate_up_keeps_gate_and_up_of_the_same_columns() -> None:
    full, shards = _shards()
    gate, up = full["layers.0.mlp.gate_up_weight"].split([9, 9])
    for r, s in enumerate(shards):
        lgate, lup = s["layers.0.mlp.gate_up_weight"].split([3, 3])
        assert torch.equal(lgate, gate[3 * r : 3 * r + 3])
        assert torch.equal(lup, up[3 * r : 3 * r + 3])


def test_vocab_shards_pad_and_concatenate_back() -> None:
    full, shards = _shards()
    rows = torch.cat([s["embed"] for s in shards])  # [3 * 4, E]
    assert rows.shape[0] == 12
    assert torch.equal(rows[:10], full["embed"])
    assert not rows[10:].any()  # padding: zero rows no id points at
    for s in shards:
        assert torch.equal(s["norm.weight"], full["norm.weight"])


def test_sizes_that_do_not_divide_the_heads_are_refused() -> None:
    smollm = dataclasses.replace(CFG, num_heads=9, num_kv_heads=3, intermediate_size=1536)
    check_tensor_parallel(smollm, 3)
    check_tensor_parallel(smollm, 1)
    with pytest.raises(ValueError, match=r"does not divide num_attention_heads \(9\) and "
                       r"num_key_value_heads \(3\).*9 attention heads, 3 KV heads"):  # fmt: skip
        check_tensor_parallel(smollm, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        check_tensor_parallel(smollm, 0)


def test_engine_config_checks_tensor_parallel_size(model_path: Path) -> None:
    """The default model (prepared: its config is read): 9 heads, 3 KV heads."""
    assert EngineConfig(device="cpu", tensor_parallel_size=3).weights_for("cpu") == "dense"
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 does not divide .*\(9\)"):
        EngineConfig(device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="weights=native: tensor parallelism runs dense"):
        EngineConfig(device="cpu", weights="native", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer"):
        EngineConfig(device="cpu", tensor_parallel_size=True)  # type: ignore[arg-type]


# --- per family, as a rank loads its checkpoint ----------------------------------------


class Place:
    """All :func:`load_model` reads of a rank's group: where it stands (no collective)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def _rank_models(folder: Path, size: int) -> list[CausalLM]:
    """Every rank's model of ``folder``, in float64 (left dense: not packed)."""
    cfg = ModelConfig.from_pretrained(folder)
    cpu = torch.device("cpu")
    places = [Place(r, size) for r in range(size)]
    return [load_model(folder, cfg, cpu, torch.float64, p) for p in places]  # type: ignore[arg-type]


def _part(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = t.shape[0] // size
    return t[rank * n : (rank + 1) * n].double()


def test_phi3s_fused_tensors_are_cut_section_by_section(tmp_path: Path, model_path: Path) -> None:
    """``qkv_proj`` -> ``[q_r; k_r; v_r]``, ``gate_up_proj`` -> ``[gate_r; up_r]``."""
    hf = test_phi3.build_phi3("phi3", tmp_path, model_path)
    layer = hf.model.layers[1]
    h, hkv, d = 4, 2, 16  # test_families.TINY's heads, head_dim 64 / 4
    q, k, v = layer.self_attn.qkv_proj.weight.split([h * d, hkv * d, hkv * d])
    gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
    for r, model in enumerate(_rank_models(tmp_path, 2)):
        attn, mlp = model.decoder_layers()[1].attn, model.decoder_layers()[1].mlp
        want = torch.cat([_part(q, r, 2), _part(k, r, 2), _part(v, r, 2)])
        assert torch.equal(attn.qkv_weight, want)
        assert torch.equal(mlp.gate_up_weight, torch.cat([_part(gate, r, 2), _part(up, r, 2)]))
        assert model.rope is not None and model.rope.partial  # 12 of 16 values rotate


def test_olmo2s_qk_norm_weights_go_with_their_heads(tmp_path: Path, model_path: Path) -> None:
    hf = test_families.build_checkpoint("olmo2", tmp_path, model_path)
    attn = hf.model.layers[0].self_attn
    for r, model in enumerate(_rank_models(tmp_path, 2)):
        ours = model.decoder_layers()[0].attn
        assert ours.q_norm is not None and ours.k_norm is not None
        assert torch.equal(ours.q_norm.weight, _part(attn.q_norm.weight, r, 2))  # [H D / 2]
        assert torch.equal(ours.k_norm.weight, _part(attn.k_norm.weight, r, 2))  # [Hkv D / 2]


def test_gemma3s_per_head_norms_stay_whole(tmp_path: Path, model_path: Path) -> None:
    hf = test_gemma.build_checkpoint("gemma3", tmp_path, model_path)
    attn = hf.model.layers[0].self_attn
    for model in _rank_models(tmp_path, 2):
        ours = model.decoder_layers()[0].attn
        assert ours.q_norm is not None and ours.k_norm is not None
        assert torch.equal(ours.q_norm.weight, attn.q_norm.weight.double())  # [head_dim]
        assert torch.equal(ours.k_norm.weight, attn.k_norm.weight.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["llama", "olmo", "gemma"])
def test_a_norm_split_over_ranks_scales_as_the_whole_norm(kind: str, dtype: torch.dtype) -> None:
    """Each rank's slice, normalised by the mean of squares of all slices (what
    ``split_rms_norms`` all-reduces), is the whole norm's slice."""
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(7, 24, generator=gen)).to(dtype)
    weight = (0.3 * torch.randn(24, generator=gen) + (kind != "gemma")).to(dtype)

    def norm(n: int, w: torch.Tensor) -> RMSNorm:
        out = (
            OffsetRMSNorm(n, 1e-6)
            if kind == "gemma"
            else RMSNorm(n, 1e-6, scale_in_fp32=kind == "olmo")
        )
        out.weight = torch.nn.Parameter(w, requires_grad=False)
        return out

    whole = norm(24, weight)(x)
    parts = x.split(8, dim=1)  # 3 ranks
    mean_sq = sum(p.float().pow(2).sum(-1, keepdim=True) for p in parts) / 24
    split = [norm(8, w).scaled(p, mean_sq) for p, w in zip(parts, weight.split(8), strict=True)]
    got = torch.cat(split, dim=1)
    assert got.dtype == dtype
    # the fp32 sums differ only in order: at most one rounding step apart
    tol = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(got, whole, rtol=tol, atol=tol)
