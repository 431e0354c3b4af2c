"""The compiled CPU decode kernel: its build, its cache, its checks, and its answers.

tests/engine/attention/test_backends.py runs every paged-attention case through it as well.
"""

from __future__ import annotations

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


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token ``[H, D]`` over ``k``/``v`` ``[L, Hkv, D]``, in float64."""
    groups = q.shape[0] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).double()
    v = v.repeat_interleave(groups, dim=1).double()
    p = (torch.einsum("hd,lhd->hl", q.double(), k) * scale).softmax(-1)
    return torch.einsum("hl,lhd->hd", p, v).float()


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
