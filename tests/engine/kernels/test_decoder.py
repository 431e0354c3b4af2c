"""The fused decoder step (engine/kernels/decoder.py, csrc/decoder.c) against the op-by-op one.

Tiny random models with quantized projections run the same steps both ways, each
with its own KV pool: prefill chunks with and without a cached prefix and decode
rows in one batch, scattered block tables, blocks smaller than a chunk. Both paths
use the same matmul kernel; they differ in the order of fp32 sums (norms, attention),
so hidden states and the KV pools they write agree to 1e-4.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.engine.kernels.test_kquant import random_kblocks
from tests.engine.kernels.test_quant import random_blocks
from tokenrelay.engine.attention.cpu_kernel import CpuBackend
from tokenrelay.engine.attention.metadata import build_metadata
from tokenrelay.engine.kernels import decoder
from tokenrelay.engine.kernels.build import ENV_SWITCH, load
from tokenrelay.engine.kernels.cpu_attention import paged_decode
from tokenrelay.engine.kernels.quant import KQTYPES, QuantStack, QuantWeight
from tokenrelay.engine.models import llama
from tokenrelay.engine.models.config import ModelConfig, RopeConfig
from tokenrelay.engine.models.families import model_class
from tokenrelay.engine.models.llama import CausalLM, DecoderLayer
from tokenrelay.engine.runner.kv_cache import KVCache

BLOCK = 4
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _needs_the_library() -> None:
    if decoder.decoder_library() is None:
        pytest.skip("the fused decoder did not build here (no C compiler?)")


def quant(n: int, k: int, qtype: str, rng: np.random.Generator) -> QuantWeight:
    """Random blocks of ``qtype`` ``[n, k]`` (test_quant.py's or test_kquant.py's)."""
    make = random_kblocks if qtype in KQTYPES else random_blocks
    blocks = make(n, k, qtype, rng)
    return QuantWeight(torch.from_numpy(blocks), qtype)


# "K_MIX": the types of a Q4_K_M file, mixed within a layer: q/k Q4_K and v Q6_K stacked
# (QuantStack), o Q5_K, gate/up Q4_K stacked, down Q6_K (hidden and FFN 256 wide).
K_MIX = "K_MIX"


def tiny_model(*, head_dim: int, qwen3: bool, qtype: str, seed: int = 0) -> CausalLM:
    """Two layers, GQA (4 query heads, 2 KV heads); ``qwen3``: biases and q/k norms."""
    width, inter = (256, 256) if qtype == K_MIX else (128, 160)
    cfg = ModelConfig(
        model_type="qwen3" if qwen3 else "llama", vocab_size=96, hidden_size=width,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=head_dim,
        intermediate_size=inter, rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0),
        max_position_embeddings=512, tie_word_embeddings=True, qkv_bias=qwen3,
        o_bias=qwen3, mlp_bias=qwen3, qk_norm=qwen3,
    )  # fmt: skip
    return quantized_model(cfg, qtype, seed)


def quantized_model(cfg: ModelConfig, qtype: str, seed: int = 0) -> CausalLM:
    """``cfg``'s family (``model_class``) with random quantized projections of ``qtype``
    and random fp32 norms and biases (norm weights near 1)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    h, e, i = cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    kv_n = cfg.num_kv_heads * cfg.head_dim
    for layer in model.decoder_layers():
        attn, mlp = layer.attn, layer.mlp
        if qtype == K_MIX:
            attn.qkv_packed = QuantStack(
                [quant(h, e, "Q4_K", rng), quant(kv_n, e, "Q4_K", rng), quant(kv_n, e, "Q6_K", rng)]
            )
            attn.o_packed = quant(e, h, "Q5_K", rng)
            mlp.gate_up_packed = QuantStack([quant(i, e, "Q4_K", rng), quant(i, e, "Q4_K", rng)])
            mlp.down_packed = quant(e, i, "Q6_K", rng)
        else:
            attn.qkv_packed, attn.o_packed = (
                quant(h + 2 * kv_n, e, qtype, rng),
                quant(e, h, qtype, rng),
            )
            mlp.gate_up_packed = quant(2 * i, e, qtype, rng)
            mlp.down_packed = quant(e, i, qtype, rng)
        for holder, attr in ((attn, "qkv_weight"), (attn, "o_weight"),
                             (mlp, "gate_up_weight"), (mlp, "down_weight")):  # fmt: skip
            setattr(holder, attr, torch.nn.Parameter(torch.empty(0), requires_grad=False))
    state = {}
    for name, p in model.named_parameters():
        if p.is_meta and p.numel():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            state[name] = base + 0.1 * torch.randn(p.shape, generator=gen)
    model.load_state_dict(state, strict=False, assign=True)
    model.init_rope(CPU)
    return model.eval()


def run_steps(
    model: CausalLM,
    fused: bool,
    steps: list[list[tuple[int, int, list[int]]]],
    kv_dtype: torch.dtype = torch.float32,
) -> Any:
    """Run ``steps`` (each a list of (q_len, start, block table)) -> hidden states, KV pool
    (of ``kv_dtype``)."""
    cfg = model.cfg
    saved = model.fused
    if not fused:
        model.fused = None
    cache = KVCache(cfg, num_blocks=12, block_size=BLOCK, dtype=kv_dtype, device=CPU)
    gen = torch.Generator().manual_seed(7)
    outs = []
    try:
        for items in steps:
            q_lens = [n for n, _, _ in items]
            meta = build_metadata(
                q_lens, [s for _, s, _ in items], [bt for _, _, bt in items],
                block_size=BLOCK, device=CPU,
                backend=CpuBackend(CPU, torch.float32, paged_decode()), plan=not fused,
            )  # fmt: skip
            ids = torch.randint(0, cfg.vocab_size, (sum(q_lens),), generator=gen)
            with torch.inference_mode():
                outs.append(model(ids, meta.positions, meta, cache).clone())
    finally:
        model.fused = saved
    return outs, cache.data.clone()


# A: 10-token prompt, then decodes; B: 5 tokens, then a 7-token chunk on its cached prefix;
# C joins with 3 tokens. Tables are scattered over the pool, blocks of 4 split every chunk.
STEPS = [
    [(10, 0, [3, 0, 9]), (5, 0, [5, 1])],
    [(1, 10, [3, 0, 9]), (7, 5, [5, 1, 7]), (3, 0, [2])],
    [(1, 11, [3, 0, 9]), (1, 12, [5, 1, 7, 4]), (1, 3, [2])],
    [(1, 12, [3, 0, 9, 11]), (1, 13, [5, 1, 7, 4]), (1, 4, [2, 6])],
]


@pytest.mark.parametrize(
    ("head_dim", "qwen3", "qtype"),
    [
        (32, False, "Q4_1"),
        (64, False, "Q4_0"),
        (64, True, "Q8_0"),
        (32, True, "Q4_1"),
        (32, False, "Q5_0"),
        (64, True, "Q5_1"),
        (64, False, K_MIX),
        (64, True, K_MIX),
    ],
)
def test_fused_steps_match_the_op_by_op_decoder(head_dim: int, qwen3: bool, qtype: str) -> None:
    model = tiny_model(head_dim=head_dim, qwen3=qwen3, qtype=qtype)
    assert model.fuse() and model.fused is not None
    want, want_kv = run_steps(model, False, STEPS)
    got, got_kv = run_steps(model, True, STEPS)
    for w, g in zip(want, got, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_kv, want_kv, rtol=1e-4, atol=1e-4)
    assert got_kv.abs().sum() > 0  # the fused path wrote the pool


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q5_0", K_MIX])
@pytest.mark.parametrize("threads", [1, 3, 5])
def test_every_thread_count_gives_the_same_step(threads: int, qtype: str) -> None:
    """The step's phases split rows, heads and tasks over however many threads there are,
    more threads than rows included; each thread waits at the step's own barriers."""
    model = tiny_model(head_dim=32 if qtype != K_MIX else 64, qwen3=False, qtype=qtype)
    assert model.fuse()
    before = torch.get_num_threads()
    want, want_kv = run_steps(model, True, STEPS)
    try:
        torch.set_num_threads(threads)
        got, got_kv = run_steps(model, True, STEPS)
    finally:
        torch.set_num_threads(before)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_kv, want_kv, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("head_qtype", "layers"), [("Q8_0", "Q4_1"), ("Q4_1", "Q4_1"),
                                                    ("Q5_1", "Q5_0"), ("Q6_K", K_MIX)])  # fmt: skip
def test_the_lm_head_within_the_step(head_qtype: str, layers: str) -> None:
    """With a quantized LM head the step can end with every row's logits: the same numbers
    as the head applied to the hidden states afterwards (one row, and enough rows for the
    panel path)."""
    model = tiny_model(head_dim=32 if layers != K_MIX else 64, qwen3=True, qtype=layers)
    vocab, hidden = model.cfg.vocab_size, model.cfg.hidden_size
    model.head_packed = quant(vocab, hidden, head_qtype, np.random.default_rng(3))
    assert model.fuse() and model.fused is not None and model.fused.vocab == vocab
    cache = KVCache(model.cfg, num_blocks=12, block_size=BLOCK, dtype=torch.float32, device=CPU)
    gen = torch.Generator().manual_seed(11)
    for q_lens, starts, tables in (([1], [0], [[3]]), ([20], [0], [[0, 1, 2, 4, 5]])):
        meta = build_metadata(
            q_lens, starts, tables, block_size=BLOCK, device=CPU,
            backend=CpuBackend(CPU, torch.float32, paged_decode()), plan=False,
        )  # fmt: skip
        ids = torch.randint(0, vocab, (sum(q_lens),), generator=gen)
        logits = torch.full((sum(q_lens), vocab), float("nan"))
        with torch.inference_mode():
            hidden = model(ids, meta.positions, meta, cache, logits)
            want = model.compute_logits(hidden)
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="logits must be"):
        model(ids, meta.positions, meta, cache, torch.empty(3, vocab))


def test_fuse_needs_every_projection_quantized() -> None:
    model = tiny_model(head_dim=32, qwen3=False, qtype="Q4_1")
    layer = model.layers[1]
    assert isinstance(layer, DecoderLayer)
    layer.mlp.down_packed = None  # a dense projection (F.linear on down_weight)
    assert not model.fuse() and model.fused is None


def test_bad_step_inputs_are_refused() -> None:
    model = tiny_model(head_dim=32, qwen3=False, qtype="Q4_1")
    assert model.fuse() and model.fused is not None
    fused = model.fused
    cache = KVCache(model.cfg, num_blocks=4, block_size=BLOCK, dtype=torch.float32, device=CPU)
    x, cs = torch.zeros(2, 128), torch.zeros(2, 16)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    seqs, slots = torch.zeros(2, dtype=torch.int64), torch.tensor([0, 1])
    lens = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="bind_cache"):
        fused.forward(x, cs, cs, slots, tables, seqs, lens)
    with pytest.raises(ValueError, match="KV pool"):
        fused.bind_cache(cache.data[:1])
    with pytest.raises(ValueError, match="float16 or float32"):
        fused.bind_cache(cache.data.bfloat16())
    fused.bind_cache(cache.data)
    bad = {
        "slot outside": (x, slots + 100, tables, seqs, lens),
        "block outside": (x, slots, tables + 10, seqs, lens),
        "beyond its block table": (x, slots, tables, seqs, lens + 8),
        "bad seq": (x, slots, tables, seqs + 1, lens),
        "lens must be int32": (x, slots, tables, seqs, lens.long()),
        "x must be": (torch.zeros(2, 64), slots, tables, seqs, lens),
    }
    for why, (xx, sl, tb, sq, ln) in bad.items():
        with pytest.raises(ValueError, match=why):
            fused.forward(xx, cs, cs, sl, tb, sq, ln)
    out = fused.forward(x.clone(), cs, cs, slots, tables, seqs, lens)
    assert out.shape == (2, 128) and torch.isfinite(out).all()


@pytest.mark.parametrize("switch", [ENV_SWITCH, decoder.FUSED_SWITCH])
def test_the_switches_turn_it_off(switch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    decoder.decoder_library.cache_clear()
    monkeypatch.setenv(switch, "0")
    try:
        assert decoder.decoder_library() is None
        assert not tiny_model(head_dim=32, qwen3=False, qtype="Q4_1").fuse()
    finally:
        monkeypatch.delenv(switch)
        decoder.decoder_library.cache_clear()


# --- a float16 KV pool --------------------------------------------------------------------

# Largest difference, over the largest magnitude of the fp32 run, of the random tiny models'
# hidden states and pools: fp16 K/V (11-bit significands) against fp32 ones; the fused step
# against the op-by-op one over fp16 pools (each rounds its own fp32 K/V, which differ in
# their last bits, so now and then one lands on the other side of a rounding tie).
F16_VS_F32 = 2e-2
F16_FUSED_VS_OPS = 1e-2


def _rel(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() / scale.abs().max().item()


@pytest.mark.parametrize(("head_dim", "qwen3", "qtype"),
                         [(32, False, "Q4_1"), (64, True, "Q8_0"), (64, False, K_MIX)])  # fmt: skip
def test_a_float16_pool(head_dim: int, qwen3: bool, qtype: str) -> None:
    """The fused step writes K and V rounded to nearest even (the first layer's of the first
    step: exactly the fp32 pool's values as torch rounds them), attends to them as the op-by-op
    decoder does over the same fp16 pool, and stays near the fp32 pool's results."""
    model = tiny_model(head_dim=head_dim, qwen3=qwen3, qtype=qtype)
    assert model.fuse() and model.fused is not None
    f32, f32_kv = run_steps(model, True, STEPS)
    f16, f16_kv = run_steps(model, True, STEPS, torch.float16)
    assert f16_kv.dtype == torch.float16
    _, first32 = run_steps(model, True, STEPS[:1])
    _, first16 = run_steps(model, True, STEPS[:1], torch.float16)
    assert torch.equal(first16[0], first32[0].half())  # layer 0: the same fp32 values, rounded
    assert first16.abs().sum() > 0
    ops, ops_kv = run_steps(model, False, STEPS, torch.float16)  # the torch path, same pool
    for got, want, ref in zip(f16, ops, f32, strict=True):
        assert torch.isfinite(got).all()
        assert _rel(got, want, ref) < F16_FUSED_VS_OPS
    assert _rel(f16_kv, ops_kv, f32_kv) < F16_FUSED_VS_OPS
    if qtype == K_MIX:  # K-quant products round their activations to int8 per 256 values, so
        return  # a K/V change of 1e-3 moves them by whole steps (test_kquant_model.py)
    for got, ref in zip(f16, f32, strict=True):
        assert _rel(got, ref, ref) < F16_VS_F32
    assert _rel(f16_kv, f32_kv, f32_kv) < F16_VS_F32


@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-f16c",),
                                   ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c")],
                         ids=" ".join)  # fmt: skip
def test_every_build_writes_and_reads_the_float16_pool_alike(
    flags: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The F16C, AVX-512 and portable conversions round alike (nearest even, bit for bit),
    and every build's step over an fp16 pool gives the native build's numbers."""
    model = tiny_model(head_dim=64, qwen3=True, qtype="Q4_0")
    assert model.fuse()
    want, want_kv = run_steps(model, True, STEPS, torch.float16)
    narrow = load(decoder.SOURCE, extra_flags=flags)
    monkeypatch.setattr(llama, "decoder_library", lambda: narrow)
    assert model.fuse()
    got, got_kv = run_steps(model, True, STEPS[:1], torch.float16)
    _, first32 = run_steps(model, True, STEPS[:1])
    assert torch.equal(got_kv[0], first32[0].half())
    got, got_kv = run_steps(model, True, STEPS, torch.float16)
    for w, g in zip(want, got, strict=True):
        assert _rel(g, w, w) < F16_FUSED_VS_OPS
    assert _rel(got_kv, want_kv, want_kv) < F16_FUSED_VS_OPS
