"""K-quant weights (Q4_K, Q5_K, Q6_K: engine/kernels/csrc/kquant.c) against float64.

The reference is gguf's own ``gguf.quants.dequantize`` times the input in float64.
The kernel quantizes each row of ``x`` to int8 per 256 values and sums in integers, so

* against ``x`` as the kernel quantized it (``QuantKernel.quantized_x``) the product is
  exact up to the fp32 scaling of each super-block's exact integer sum: relative error
  below 1e-6 of ``|x| @ |W|^T``;
* against ``x`` itself the error is at most what rounding ``x`` to its int8 grid can
  move the product (half a step, ``max|x_block| / 254``, times ``|W|``), plus that.

And a row's result never depends on the other rows of the batch: bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from tests.engine.kernels.test_quant import random_blocks
from tokenrelay.engine.kernels import quant
from tokenrelay.engine.kernels.quant import KQTYPES, QuantKernel, QuantStack, QuantWeight

GGML = gguf.GGMLQuantizationType
EXACT = 1e-6


@pytest.fixture(scope="module")
def kernel() -> QuantKernel:
    k = quant.quant_kernel()
    if k is None:
        pytest.skip("the quant kernel did not build here (no C compiler?)")
    return k


def random_kblocks(
    n: int, k: int, qtype: str, rng: np.random.Generator, scale: float = 0.002
) -> np.ndarray:
    """Random super-blocks of ``qtype`` ``[n, k / 256 * bytes]``: every quant, scale and
    min byte random, ``d`` (and ``dmin``) finite fp16 values of about ``scale``."""
    _, size = KQTYPES[qtype]
    nb = k // 256
    raw = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)

    def halves(scale: float) -> np.ndarray:
        v = (rng.standard_normal((n, nb)) * scale).astype(np.float16)
        return v.view(np.uint8).reshape(n, nb, 2)

    if qtype == "Q6_K":
        raw[..., 208:210] = halves(scale)
    else:
        raw[..., 0:2] = halves(scale)
        raw[..., 2:4] = halves(scale)
    return raw.reshape(n, -1)


def reference(raw: np.ndarray, qtype: str) -> np.ndarray:
    return dequantize(raw, GGML[qtype]).astype(np.float64)


def check(y: torch.Tensor, x: torch.Tensor, xq: torch.Tensor, w64: np.ndarray) -> None:
    """``y`` against the exact product with ``xq`` and within the int8 bound of ``x``'s."""
    y64, x64, xq64 = y.double().numpy(), x.double().numpy(), xq.double().numpy()
    scale = np.abs(xq64) @ np.abs(w64).T
    exact = np.abs(y64 - xq64 @ w64.T)
    assert (exact <= EXACT * scale + 1e-30).all(), (exact / np.maximum(scale, 1e-30)).max()
    m, k = x64.shape
    half_step = np.abs(x64).reshape(m, k // 256, 256).max(axis=2) / 254.0  # [M, K / 256]
    bound = np.repeat(half_step, 256, axis=1) @ np.abs(w64).T + EXACT * scale
    assert (np.abs(y64 - x64 @ w64.T) <= bound * 1.0001).all()


def test_the_reference_decodes_the_documented_q4_k_layout() -> None:
    """gguf's Q4_K dequantization is the layout kquant.c documents (a fair reference)."""
    rng = np.random.default_rng(3)
    raw = random_kblocks(2, 256, "Q4_K", rng)
    b = raw.reshape(2, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float64)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float64)
    s, qs = b[:, 4:16].astype(np.int64), b[:, 16:]
    want = np.zeros((2, 256))
    for j in range(8):
        if j < 4:
            sc, mn = s[:, j] & 63, s[:, j + 4] & 63
        else:
            sc = (s[:, j + 4] & 15) | ((s[:, j - 4] >> 6) << 4)
            mn = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
        chunk = qs[:, 32 * (j // 2) : 32 * (j // 2) + 32]
        q = chunk & 15 if j % 2 == 0 else chunk >> 4
        want[:, 32 * j : 32 * j + 32] = d * sc[:, None] * q - dmin * mn[:, None]
    np.testing.assert_allclose(reference(raw, "Q4_K"), want, rtol=1e-6, atol=1e-9)


# rows of x: one (decode), not multiples of the 4-row tile, past a 64-row chunk
ROWS = (1, 2, 3, 5, 8, 17, 64, 70)


@pytest.mark.parametrize("qtype", list(KQTYPES))
def test_matmul_against_float64(qtype: str, kernel: QuantKernel) -> None:
    rng = np.random.default_rng(KQTYPES[qtype][0])
    gen = torch.Generator().manual_seed(1)
    for k, n in ((256, 1), (256, 7), (512, 33), (2048, 64)):
        raw = random_kblocks(n, k, qtype, rng)
        w, w64 = QuantWeight(torch.from_numpy(raw), qtype), reference(raw, qtype)
        assert w.shape == (n, k) and w.nbytes == raw.size and w.block_weights == 256
        for m in ROWS:
            x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
            y = w.matmul(x)
            assert y.shape == (m, n) and y.dtype == torch.float32
            check(y, x, kernel.quantized_x(x), w64)


@pytest.mark.parametrize("qtype", list(KQTYPES))
def test_a_rows_result_does_not_depend_on_its_batch(qtype: str, kernel: QuantKernel) -> None:
    """Bit for bit: each row alone, in any batch, at any position."""
    rng = np.random.default_rng(11)
    w = QuantWeight(torch.from_numpy(random_kblocks(45, 1024, qtype, rng)), qtype)
    x = torch.randn(70, 1024, generator=torch.Generator().manual_seed(2))
    whole = w.matmul(x)
    alone = torch.cat([w.matmul(x[i : i + 1]) for i in range(70)])
    assert torch.equal(whole, alone)
    perm = torch.randperm(70, generator=torch.Generator().manual_seed(3))
    assert torch.equal(w.matmul(x[perm]), whole[perm])
    assert torch.equal(w.matmul(x[5:12]), whole[5:12])


def test_rows_and_dequantize_match_the_reference(kernel: QuantKernel) -> None:
    rng = np.random.default_rng(4)
    for qtype in KQTYPES:
        raw = random_kblocks(9, 512, qtype, rng)
        w, w64 = QuantWeight(torch.from_numpy(raw), qtype), reference(raw, qtype)
        ids = torch.tensor([8, 0, 3, 3])
        np.testing.assert_allclose(w.rows(ids).numpy(), w64[ids.numpy()], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(w.dequantize().numpy(), w64, rtol=1e-6, atol=1e-7)
        fallback = w.dequantize(use_kernel=False).numpy()  # gguf-py, without the kernel
        np.testing.assert_allclose(fallback, w64, rtol=1e-6, atol=1e-7)
        x = torch.randn(3, 512)
        np.testing.assert_allclose(
            w.matmul(x, use_kernel=False).double().numpy(), x.double().numpy() @ w64.T,
            rtol=1e-4, atol=1e-4,
        )  # fmt: skip


@pytest.mark.parametrize(
    "flags",
    [("-mno-avx512f",), ("-mno-avx512f", "-mno-avxvnni"),
     ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c")],
    ids=["avx2-vnni", "avx2", "portable"],
)  # fmt: skip
def test_the_narrower_paths(flags: tuple[str, ...], tmp_path: Path) -> None:
    """Built without AVX-512 (AVX2 with and without AVX-VNNI, portable C): the same integer
    sums, the same bounds, rows still independent of their batch."""
    try:
        narrow = QuantKernel(quant.load(quant.SOURCE, tmp_path, flags))
    except quant.BUILD_ERRORS as exc:
        pytest.skip(f"could not build with {flags}: {exc}")
    rng = np.random.default_rng(6)
    gen = torch.Generator().manual_seed(6)
    for qtype in KQTYPES:
        raw = random_kblocks(13, 512, qtype, rng)
        w, w64 = QuantWeight(torch.from_numpy(raw), qtype), reference(raw, qtype)
        for m in (1, 3, 5, 66):
            x = torch.randn(m, 512, generator=gen)
            y = torch.empty(m, 13)
            narrow.matmul(x, w, y)
            check(y, x, narrow.quantized_x(x), w64)
            alone = torch.empty(1, 13)
            narrow.matmul(x[m - 1 :], w, alone)
            assert torch.equal(alone, y[m - 1 :])
        out = torch.empty(2, 512)
        narrow.rows(w, torch.tensor([12, 1]), out)
        np.testing.assert_allclose(out.numpy(), w64[[12, 1]], rtol=1e-6, atol=1e-7)


def test_a_stack_of_parts_in_different_types(kernel: QuantKernel) -> None:
    """q/k in Q4_K and v in Q6_K, as a Q4_K_M file has them: one matrix, nothing copied."""
    rng = np.random.default_rng(8)
    raws = [random_kblocks(n, 512, t, rng) for n, t in ((64, "Q4_K"), (16, "Q4_K"), (16, "Q6_K"))]
    tensors = [torch.from_numpy(r) for r in raws]
    parts = [QuantWeight(b, t) for b, t in zip(tensors, ("Q4_K", "Q4_K", "Q6_K"), strict=True)]
    stack = QuantStack(parts)
    assert stack.shape == (96, 512) and stack.qtypes == ("Q4_K", "Q4_K", "Q6_K")
    assert [p.data_ptr for p in stack.parts] == [b.data_ptr() for b in tensors]  # no copy
    x = torch.randn(5, 512)
    y = stack.matmul(x)
    assert torch.equal(y, torch.cat([p.matmul(x) for p in parts], dim=1))
    w64 = np.concatenate([reference(r, t) for r, t in zip(raws, stack.qtypes, strict=True)])
    check(y, x, kernel.quantized_x(x), w64)
    narrower = QuantWeight(torch.from_numpy(random_kblocks(4, 256, "Q4_K", rng)), "Q4_K")
    with pytest.raises(ValueError, match="K=512"):
        QuantStack([parts[0], narrower])
    with pytest.raises(ValueError, match="at most 3"):
        QuantStack(parts + parts[:1])
    with pytest.raises(ValueError, match="no parts"):
        QuantStack([])


def test_bad_k_quant_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 144"):
        QuantWeight(torch.zeros(2, 100, dtype=torch.uint8), "Q4_K")
    w = QuantWeight(torch.zeros(2, 144, dtype=torch.uint8), gguf.GGMLQuantizationType.Q4_K)
    assert w.shape == (2, 256) and w.qtype == "Q4_K" and QuantWeight(w.blocks, 12).k == 256
    with pytest.raises(ValueError, match=r"\[\.\.\., 256\]"):
        w.matmul(torch.zeros(1, 32))
    with pytest.raises(ValueError, match="unsupported qtype"):
        QuantWeight(torch.zeros(2, 110, dtype=torch.uint8), "Q3_K")


def test_q8_0_in_whole_blocks_takes_the_int8_path(kernel: QuantKernel) -> None:
    """On an AVX512-VNNI CPU, Q8_0 with K a multiple of 256 runs the int8 products too:
    exact against the quantized x, the int8 bound against x, batch-invariant."""
    rng = np.random.default_rng(9)
    raw = random_blocks(37, 1024, "Q8_0", rng)
    w, w64 = QuantWeight(torch.from_numpy(raw), "Q8_0"), reference(raw, "Q8_0")
    narrow = QuantWeight(torch.from_numpy(random_blocks(3, 576, "Q8_0", rng)), "Q8_0")
    assert not kernel.int8_activations(narrow)  # 576: not whole blocks of 256
    if not kernel.int8_activations(w):
        pytest.skip("this CPU has no AVX512-VNNI: Q8_0 keeps its fp32 path")
    x = torch.randn(21, 1024, generator=torch.Generator().manual_seed(4))
    y = w.matmul(x)
    check(y, x, kernel.quantized_x(x), w64)
    assert torch.equal(torch.cat([w.matmul(x[i : i + 1]) for i in range(21)]), y)


def test_q4_k_repacked_16_rows_at_a_time(kernel: QuantKernel) -> None:
    """The AVX512-VNNI kernel's own form of Q4_K (kquant_x16.c): the same products, exact
    against the reference like the file's form, rows independent of their batch."""
    rng = np.random.default_rng(21)
    gen = torch.Generator().manual_seed(21)
    for n, k in ((16, 256), (48, 512), (64, 2048)):
        raw = random_kblocks(n, k, "Q4_K", rng)
        w, w64 = QuantWeight(torch.from_numpy(raw), "Q4_K"), reference(raw, "Q4_K")
        packed = kernel.interleave(w)
        if packed is None:
            pytest.skip("no repacked Q4_K form in this build (no AVX512-VNNI)")
        assert packed.numel() == n // 16 * k // 256 * quant.Q4_KX_GROUP_BYTES
        for m in ROWS:
            x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
            y = torch.empty(m, n)
            kernel.matmul_raw(x, packed.data_ptr(), n, quant.Q4_KX_ID, y)
            check(y, x, kernel.quantized_x(x), w64)
            alone = torch.empty(1, n)
            kernel.matmul_raw(x[m - 1 :], packed.data_ptr(), n, quant.Q4_KX_ID, alone)
            assert torch.equal(alone, y[m - 1 :])
    odd = QuantWeight(torch.from_numpy(random_kblocks(20, 256, "Q4_K", rng)), "Q4_K")
    assert kernel.interleave(odd) is None  # not whole groups of 16 rows: the file's form
