"""The compiled CPU decode kernel: its build, its cache, its checks, and its answers.

tests/engine/attention/test_backends.py runs every paged-attention case through it as well.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import pytest
import torch

from tokenrelay.engine.kernels import cpu_attention
from tokenrelay.engine.kernels.build import build, prebuild
from tokenrelay.engine.kernels.cpu_attention import PagedDecode, paged_decode


@pytest.fixture(scope="module")
def kernel() -> PagedDecode:
    k = paged_decode()
    if k is None:
        pytest.skip("the CPU kernel did not build here (no C compiler?)")
    return k


def attend(
    kernel: PagedDecode,
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    rows: torch.Tensor,
    seqs: torch.Tensor,
    scale: float,
) -> None:
    """Plan the rows (as attention.py does once a step), then one layer's call."""
    plan = kernel.plan(tables, lens, rows, seqs, k_cache.shape[1])
    kernel(q, out, k_cache, v_cache, plan, scale)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float = 0.0
) -> torch.Tensor:
    """One query token ``[H, D]`` over ``k``/``v`` ``[L, Hkv, D]``, in float64 (scores
    soft-capped where ``softcap``)."""
    groups = q.shape[0] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).double()
    v = v.repeat_interleave(groups, dim=1).double()
    s = torch.einsum("hd,lhd->hl", q.double(), k) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    return torch.einsum("hl,lhd->hd", s.softmax(-1), v).float()


def test_strided_q_and_a_subset_of_rows(kernel: PagedDecode) -> None:
    """q as a view of a fused projection; only the listed rows are written."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, block = 6, 2, 64, 16
    lens = [1, 16, 17, 40, 333]
    tables: list[list[int]] = []
    at = 0
    for n in lens:
        tables.append(list(range(at, at + -(-n // block))))
        at += -(-n // block)
    perm = torch.randperm(at + 2, generator=gen)  # scatter the blocks over the pool
    tables = [[int(perm[b]) for b in t] for t in tables]
    k_cache = torch.randn(at + 2, block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(at + 2, block, kv_heads, dim, generator=gen)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    fused = torch.randn(len(lens) + 1, (heads + 2 * kv_heads) * dim, generator=gen)
    q = fused[:, : heads * dim].view(-1, heads, dim)  # row stride (H + 2 Hkv) D
    out = torch.full((len(lens) + 1, heads, dim), 123.0)
    rows = torch.tensor([5, 0, 3, 1], dtype=torch.int64)  # row 2 and 4 left alone
    seqs = torch.tensor([4, 0, 2, 1], dtype=torch.int64)
    attend(
        kernel,
        q,
        out,
        k_cache,
        v_cache,
        bt,
        torch.tensor(lens, dtype=torch.int32),
        rows,
        seqs,
        0.125,
    )
    for row, seq in zip(rows.tolist(), seqs.tolist(), strict=True):
        idx = torch.tensor(tables[seq])
        n = lens[seq]
        k = k_cache[idx].reshape(-1, kv_heads, dim)[:n]
        v = v_cache[idx].reshape(-1, kv_heads, dim)[:n]
        assert torch.allclose(out[row], reference(q[row], k, v, 0.125), atol=1e-5)
    assert bool((out[2] == 123.0).all()) and bool((out[4] == 123.0).all())


def test_block_ids_outside_the_pool_are_refused(kernel: PagedDecode) -> None:
    k_cache = torch.zeros(4, 16, 1, 8)
    q = torch.zeros(1, 2, 8)
    args = (torch.tensor([16], dtype=torch.int32), torch.tensor([0]), torch.tensor([0]), 1.0)
    for bad in (4, -1):
        with pytest.raises(ValueError, match="block id"):
            attend(
                kernel,
                q,
                torch.zeros(1, 2, 8),
                k_cache,
                k_cache,
                torch.tensor([[bad]]).int(),
                *args,
            )


def test_lengths_rows_and_sequences_outside_their_tables_are_refused(kernel: PagedDecode) -> None:
    k_cache = torch.zeros(4, 16, 1, 8)
    q, out = torch.zeros(2, 2, 8), torch.zeros(2, 2, 8)
    tables = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    lens = torch.tensor([20, 5], dtype=torch.int32)
    one = torch.tensor([1])
    cases = [
        (torch.tensor([33, 5], dtype=torch.int32), one, one, "context length"),  # > 2 blocks
        (torch.tensor([0, 5], dtype=torch.int32), one, one, "context length"),
        (lens, torch.tensor([2]), one, "row"),
        (lens, one, torch.tensor([2]), "sequence"),
        (lens, one, torch.tensor([-1]), "sequence"),
    ]
    for bad_lens, rows, seqs, what in cases:
        with pytest.raises(ValueError, match=what):
            attend(kernel, q, out, k_cache, k_cache, tables, bad_lens, rows, seqs, 1.0)
    attend(kernel, q, out, k_cache, k_cache, tables, lens, one, one, 1.0)  # the good call passes


def test_wrong_dtypes_are_refused(kernel: PagedDecode) -> None:
    k_cache = torch.zeros(4, 16, 1, 8)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    rows, q, out = torch.tensor([0]), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="fp32"):
        attend(kernel, q.double(), out, k_cache, k_cache, tables, lens, rows, rows, 1.0)
    with pytest.raises(ValueError, match="int32"):
        attend(kernel, q, out, k_cache, k_cache, tables.long(), lens, rows, rows, 1.0)


def test_build_is_cached_by_content(tmp_path: Path) -> None:
    source = tmp_path / "k.c"
    source.write_text("int tr_answer(void) { return 42; }\n")
    first = build(source, tmp_path / "cache")
    assert first.exists() and first.name.startswith("k-")
    mtime = first.stat().st_mtime_ns
    assert build(source, tmp_path / "cache") == first and first.stat().st_mtime_ns == mtime
    source.write_text("int tr_answer(void) { return 43; }\n")
    assert build(source, tmp_path / "cache") != first
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == []


def test_prebuild_compiles_side_by_side_and_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Libraries started by prebuild() are what build() returns: a build() while one is in
    progress waits for it instead of compiling again; a failure is left to build()."""
    sources = []
    for i in range(3):
        sources.append(tmp_path / f"k{i}.c")
        sources[-1].write_text(f"int tr_answer{i}(void) {{ return {i}; }}\n")
    broken = tmp_path / "broken.c"
    broken.write_text("int tr_broken(void) { return nope; }\n")
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="tokenrelay.engine"):
        threads = prebuild([*sources, broken], cache)
        built = [build(src, cache) for src in sources]  # while the prebuilds run
        for thread in threads:
            thread.join()
    assert all(path.exists() for path in built)
    compiled = [r for r in caplog.records if r.getMessage() == "compiling CPU kernel"]
    assert len(compiled) == 4  # each source once, the broken one included
    with pytest.raises(RuntimeError, match="nope"):
        build(broken, cache)


def test_a_compile_error_is_reported_with_the_compiler_message(tmp_path: Path) -> None:
    source = tmp_path / "broken.c"
    source.write_text("int tr_broken(void) { return nope; }\n")
    with pytest.raises(RuntimeError, match="nope"):
        build(source, tmp_path)
    assert list(tmp_path.glob("*.so")) == [] and list(tmp_path.glob(".*")) == []


def test_no_compiler_falls_back_to_torch_with_a_log_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("TOKENRELAY_HOME", str(tmp_path))
    paged_decode.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tokenrelay.engine"):
            assert paged_decode() is None
        assert "torch attention path" in caplog.text
    finally:
        paged_decode.cache_clear()


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_attention.ENV_SWITCH, "0")
    paged_decode.cache_clear()
    try:
        assert paged_decode() is None
    finally:
        paged_decode.cache_clear()


# --- float16 K/V: every read path of paged_attention.c, in each build of it ---------------

# the builds a CPU may get: AVX-512 (with F16C), AVX2 + F16C, AVX-512 without F16C's scalar
# conversions, and no vector extensions at all (the portable conversions and loops)
BUILDS = [(), ("-mno-avx512f",), ("-mno-f16c",),
          ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c")]  # fmt: skip


@pytest.fixture(scope="module", params=BUILDS, ids=lambda f: " ".join(f) or "native")
def any_build(request: pytest.FixtureRequest, kernel: PagedDecode) -> PagedDecode:
    flags = tuple(request.param)
    return kernel if not flags else PagedDecode(build(cpu_attention.SOURCE, extra_flags=flags))


def scattered_pool(
    lens: list[int], block: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """Random K/V caches in ``dtype`` with each sequence's blocks scattered over the pool;
    returns (k_cache, v_cache, padded int32 tables, tables)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block) for n in lens]
    perm = torch.randperm(sum(need) + 3, generator=gen).tolist()
    tables, at = [], 0
    for k in need:
        tables.append(perm[at : at + k])
        at += k
    shape = (len(perm), block, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    width = max(need)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, bt, tables


def history(cache: torch.Tensor, table: list[int], n: int) -> torch.Tensor:
    """The first ``n`` tokens of a sequence, ``[n, Hkv, D]`` (the cache's own dtype)."""
    return cache[torch.tensor(table)].reshape(-1, *cache.shape[2:])[:n]


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 64), (9, 3, 40), (4, 4, 36)])
@pytest.mark.parametrize("block", [16, 8])
def test_float16_caches_decode(
    any_build: PagedDecode, heads: int, kv_heads: int, dim: int, block: int
) -> None:
    """Decode rows over fp16 K/V: the float64 answer from the same fp16 values, at lengths
    on and across block boundaries, whole-head tasks and split ones."""
    lens = [1, block - 1, block, block + 1, 3 * block + 5, 200]
    k_cache, v_cache, bt, tables = scattered_pool(lens, block, kv_heads, dim, torch.float16, 3)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    rows = torch.arange(len(lens), dtype=torch.int64)
    for threads in (1, 2):  # one sequence per thread or fewer: split heads, else whole ones
        out = torch.full_like(q, float("nan"))
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(threads)
            attend(any_build, q, out, k_cache, v_cache, bt,
                   torch.tensor(lens, dtype=torch.int32), rows, rows, dim**-0.5)  # fmt: skip
        finally:
            torch.set_num_threads(before)
        for i, n in enumerate(lens):
            k = history(k_cache, tables[i], n).double()
            v = history(v_cache, tables[i], n).double()
            want = reference(q[i], k, v, dim**-0.5)
            torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-5)


def causal_rows(
    kernel: PagedDecode,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    seqs: list[int],
    lens: list[int],
    heads_per_task: int,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Row i attends to the first lens[i] tokens of sequence seqs[i] (the last ``window`` of
    them where set), as the fused decoder's rows do (consecutive rows of a prefill chunk go
    to the tile paths); returns out."""
    n, heads, dim = q.shape
    out = torch.full_like(q, float("nan"))
    rows = torch.arange(n, dtype=torch.int64)
    seq_t = torch.tensor(seqs, dtype=torch.int64)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    ctx = torch.zeros(tables.shape[0], dtype=torch.int32)  # unread: each row has its own length
    rc = kernel._fn(
        q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        tables.data_ptr(), tables.shape[1], ctx.data_ptr(), rows.data_ptr(), seq_t.data_ptr(),
        lens_t.data_ptr(), n, heads, k_cache.shape[2], dim, k_cache.shape[1], heads_per_task,
        dim**-0.5, int(k_cache.dtype == torch.float16), window, softcap,
    )  # fmt: skip
    assert rc == 0
    return out


# (sequence, first position, rows): chunks longer than a tile of 16 rows, a chunk of one
# (the decode path), a chunk that starts inside a block, decode rows between them
CHUNKS = [(0, 0, 40), (1, 21, 5), (2, 0, 1), (3, 47, 17), (1, 26, 1), (4, 3, 2)]


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 64), (9, 3, 40), (16, 1, 32)])
@pytest.mark.parametrize("block", [16, 8, 32])
def test_float16_caches_prefill_tiles(
    any_build: PagedDecode, heads: int, kv_heads: int, dim: int, block: int
) -> None:
    """Prefill chunks' causal rows over fp16 K/V (the tiled paths: AVX-512 with D a multiple
    of 16, the portable one else): the float64 answer from the same fp16 values, and each
    sequence's rows the same bits alone as in the batch."""
    seq_lens = [max(s + n for q, s, n in CHUNKS if q == i) for i in range(5)]
    k_cache, v_cache, bt, tables = scattered_pool(seq_lens, block, kv_heads, dim,
                                                  torch.float16, 5)  # fmt: skip
    seqs = [q for q, s, n in CHUNKS for _ in range(n)]
    lens = [s + j + 1 for q, s, n in CHUNKS for j in range(n)]
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    for hp in (1, kv_heads):
        out = causal_rows(any_build, q, k_cache, v_cache, bt, seqs, lens, hp)
        for i, (seq, n) in enumerate(zip(seqs, lens, strict=True)):
            k = history(k_cache, tables[seq], n).double()
            v = history(v_cache, tables[seq], n).double()
            torch.testing.assert_close(out[i], reference(q[i], k, v, dim**-0.5),
                                       rtol=1e-5, atol=1e-5)  # fmt: skip
        at = 0
        for _, _, n in CHUNKS:  # a chunk alone: the same tiles, the same bits
            alone = causal_rows(any_build, q[at : at + n].contiguous(), k_cache, v_cache, bt,
                                seqs[at : at + n], lens[at : at + n], hp)  # fmt: skip
            assert torch.equal(alone, out[at : at + n])
            at += n


@pytest.mark.parametrize(("window", "softcap"), [(9, 0.0), (20, 1.5), (0, 0.8), (1, 0.0)])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 64), (9, 3, 40)])
def test_prefill_tiles_with_a_window_and_a_cap(
    any_build: PagedDecode, heads: int, kv_heads: int, dim: int, window: int, softcap: float
) -> None:
    """A sliding-window layer's prefill rows (each sees its last ``window`` tokens) and
    soft-capped scores through the tiled paths (AVX-512 rows with D a multiple of 16, the
    portable tile else): the float64 answer, and each chunk alone gives the same bits."""
    seq_lens = [max(s + n for q, s, n in CHUNKS if q == i) for i in range(5)]
    k_cache, v_cache, bt, tables = scattered_pool(seq_lens, 8, kv_heads, dim, torch.float32, 5)
    seqs = [q for q, s, n in CHUNKS for _ in range(n)]
    lens = [s + j + 1 for q, s, n in CHUNKS for j in range(n)]
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(8)) * 3
    out = causal_rows(any_build, q, k_cache, v_cache, bt, seqs, lens, 1, window, softcap)
    for i, (seq, n) in enumerate(zip(seqs, lens, strict=True)):
        first = n - window if 0 < window < n else 0
        k = history(k_cache, tables[seq], n)[first:].double()
        v = history(v_cache, tables[seq], n)[first:].double()
        want = reference(q[i], k, v, dim**-0.5, softcap)
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-5)
    at = 0
    for _, _, n in CHUNKS:
        alone = causal_rows(any_build, q[at : at + n].contiguous(), k_cache, v_cache, bt,
                            seqs[at : at + n], lens[at : at + n], 1, window, softcap)  # fmt: skip
        assert torch.equal(alone, out[at : at + n])
        at += n


def test_float16_and_float32_caches_give_the_same_answer(kernel: PagedDecode) -> None:
    """The fp16 pool's values held in fp32 give what the fp16 pool gives (to rounding order)."""
    lens = [7, 33, 64, 130]
    k16, v16, bt, _ = scattered_pool(lens, 16, 2, 64, torch.float16, 8)
    seqs = [i for i, n in enumerate(lens) for _ in range(n)]
    rows_lens = [j + 1 for n in lens for j in range(n)]
    q = torch.randn(len(seqs), 8, 64, generator=torch.Generator().manual_seed(9))
    half = causal_rows(kernel, q, k16, v16, bt, seqs, rows_lens, 2)
    full = causal_rows(kernel, q, k16.float(), v16.float(), bt, seqs, rows_lens, 2)
    torch.testing.assert_close(half, full, rtol=1e-6, atol=1e-6)


def test_cache_dtypes_other_than_fp32_and_fp16_are_refused(kernel: PagedDecode) -> None:
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    rows, q, out = torch.tensor([0]), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)
    cache = torch.zeros(4, 16, 1, 8)
    for k, v in ((cache.bfloat16(), cache.bfloat16()), (cache.half(), cache)):
        with pytest.raises(ValueError, match="both fp32 or both fp16"):
            attend(kernel, q, out, k, v, tables, lens, rows, rows, 1.0)
    attend(kernel, q, out, cache.half(), cache.half(), tables, lens, rows, rows, 1.0)
    assert torch.equal(out, torch.zeros_like(out))  # zero K/V: the mean of zero values


@pytest.mark.parametrize("flags", BUILDS, ids=lambda f: " ".join(f) or "native")
def test_the_fp16_conversions_round_as_ieee_does(tmp_path: Path, flags: tuple[str, ...]) -> None:
    """paged_attention.c's conversions, in each build, against torch's: every fp16 value to
    float, and floats to fp16 rounded to nearest even: ties, subnormals, overflow, inf, nan."""
    source = tmp_path / "conv.c"
    source.write_text(
        f'#include "{cpu_attention.SOURCE}"\n'
        "void t_f2h(const float *x, uint16_t *y, int64_t n) { tr_f32_to_f16(y, x, n); }\n"
        "void t_h2f(const uint16_t *x, float *y, int64_t n) { tr_f16_to_f32(y, x, n); }\n"
    )
    lib = ctypes.CDLL(str(build(source, tmp_path / "cache", extra_flags=flags)))
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    got = torch.empty(every.shape, dtype=torch.float32)
    lib.t_h2f(ctypes.c_void_p(every.data_ptr()), ctypes.c_void_p(got.data_ptr()),
              ctypes.c_int64(every.numel()))  # fmt: skip
    want = every.float()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()].view(torch.int32), want[~want.isnan()].view(torch.int32))
    finite = every[every.isfinite()].double().unique()
    ties = (finite[1:] + finite[:-1]) / 2  # halfway between neighbours: exact in a float
    gen = torch.Generator().manual_seed(1)
    floats = torch.cat([
        ties.float(), ties.float().nextafter(torch.tensor(0.0)), finite.float(),
        torch.randn(5001, generator=gen) * 10.0 ** torch.randint(-9, 6, (5001,), generator=gen),
        torch.tensor([65504.0, 65519.99, 65520.0, 1e6, float("inf"), -float("inf"), 0.0, -0.0,
                      2.0**-24, 2.0**-25, 2.0**-25 * 1.0001, 2.0**-26, 1e-30, -(2.0**-14)]),
    ])  # fmt: skip
    half = torch.empty(floats.shape, dtype=torch.float16)
    lib.t_f2h(ctypes.c_void_p(floats.data_ptr()), ctypes.c_void_p(half.data_ptr()),
              ctypes.c_int64(floats.numel()))  # fmt: skip
    assert torch.equal(half.view(torch.int16), floats.half().view(torch.int16))
    nan = torch.full((3,), float("nan"))
    lib.t_f2h(ctypes.c_void_p(nan.data_ptr()), ctypes.c_void_p(half.data_ptr()),
              ctypes.c_int64(3))  # fmt: skip
    assert half[:3].isnan().all()
