"""The Triton paged-attention kernels against a float64 reference over the block tables.

Without a GPU they run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``
must be set before the kernels module is imported). Shapes stay small: the interpreter
runs each program in numpy.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess
import sys

import pytest

pytest.importorskip("triton")

from tokenrelay.engine.kernels import triton_attention as ta

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.3
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


class Pool:
    """A KV pool with shuffled block tables for sequences of the given context lengths."""

    def __init__(
        self,
        ctx: list[int],
        kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        seed: int = 0,
        extra_width: int = 1,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        need = [-(-n // block_size) for n in ctx]
        width = max([*need, 1]) + extra_width  # padded columns beyond every sequence
        num_blocks = sum(need) + 3  # spare blocks hold garbage the kernels must not read
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.randn(shape, generator=gen).to(dtype)
        self.v = torch.randn(shape, generator=gen).to(dtype)
        ids = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = torch.zeros((len(ctx), width), dtype=torch.int32)
        for b, n in enumerate(need):
            self.tables[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
            ids = ids[n:]
        self.ctx = ctx
        self.block_size = block_size
        self.gen = gen

    def kv(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's keys and values in position order, float64 ``[L, Hkv, D]``."""
        pos = torch.arange(self.ctx[b])
        blocks = self.tables[b, pos // self.block_size].long()
        return (
            self.k[blocks, pos % self.block_size].double(),
            self.v[blocks, pos % self.block_size].double(),
        )

    def dev(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        lens = torch.tensor(self.ctx, dtype=torch.int32)
        return self.k.to(DEVICE), self.v.to(DEVICE), self.tables.to(DEVICE), lens.to(DEVICE)


def reference(pool: Pool, q: torch.Tensor, q_lens: list[int]) -> torch.Tensor:
    """float64 causal attention: sequence b's last query row sits at position ctx[b] - 1."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    heads, kv_heads = q.shape[1], pool.k.shape[2]
    row = 0
    for b, q_len in enumerate(q_lens):
        k, v = pool.kv(b)
        for j in range(q_len):
            pos = pool.ctx[b] - q_len + j
            for h in range(heads):
                if pos < 0:
                    continue
                kvh = h // (heads // kv_heads)
                s = k[: pos + 1, kvh] @ q[row + j, h].double() * SCALE
                out[row + j, h] = torch.softmax(s, 0) @ v[: pos + 1, kvh]
        row += q_len
    return out


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.cpu().double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def decode(pool: Pool, heads: int, dtype: torch.dtype, num_splits: int | None) -> None:
    head_dim = pool.k.shape[3]
    q = torch.randn((len(pool.ctx), heads, head_dim), generator=pool.gen).to(dtype)
    k, v, tables, lens = pool.dev()
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    got = ta.paged_decode(q.to(DEVICE), k, v, tables, lens, SCALE, out, num_splits=num_splits)
    assert got is out
    check(out, reference(pool, q, [1] * len(pool.ctx)), dtype)


def test_available() -> None:
    assert ta.available()


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_fp32(heads: int, kv_heads: int, block_size: int, num_splits: int) -> None:
    # 1 token, block boundaries (16, 32, 256), ragged lengths spanning several key tiles
    ctx = [1, 16, 45, 32, 130] if block_size == 16 else [256, 1, 300]
    decode(Pool(ctx, kv_heads, 32, block_size, torch.float32), heads, torch.float32, num_splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_half(dtype: torch.dtype) -> None:
    decode(Pool([7, 64, 99], 2, 64, 16, dtype, seed=1), 8, dtype, 2)


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_decode_empty_context_is_zeros(num_splits: int | None) -> None:
    # a CUDA-graph batch is padded with rows of context 0: they must not be NaN
    decode(Pool([0, 5, 0], 2, 16, 16, torch.float32, seed=2), 4, torch.float32, num_splits)


def test_decode_odd_head_dim_and_group() -> None:
    # D=24 (padded to 32 with masks), G=3 query heads per KV head
    decode(Pool([3, 40], 2, 24, 16, torch.float32, seed=3), 6, torch.float32, 2)


def test_decode_strided_views() -> None:
    """q a view of a fused qkv tensor, out a view with gaps, a wide table, a context batch."""
    pool = Pool([9, 33], 2, 16, 16, torch.float32, seed=4, extra_width=5)
    qkv = torch.randn((2, 8 + 2 * 2, 16), generator=pool.gen).to(DEVICE)
    q = qkv[:, :8]
    buf = torch.zeros((2, 10, 16), device=DEVICE)
    out = buf[:, 1:9]
    k, v, tables, lens = pool.dev()
    ta.paged_decode(q, k, v, tables, lens, SCALE, out)
    check(out, reference(pool, q.cpu(), [1, 1]), torch.float32)
    assert (buf[:, 0] == 0).all() and (buf[:, 9] == 0).all()


def prefill(pool: Pool, q_lens: list[int], heads: int, dtype: torch.dtype) -> None:
    head_dim = pool.k.shape[3]
    q = torch.randn((sum(q_lens), heads, head_dim), generator=pool.gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    k, v, tables, lens = pool.dev()
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    got = ta.paged_prefill(q.to(DEVICE), k, v, tables, cu.to(DEVICE), lens, max(q_lens), SCALE, out)
    assert got is out
    check(out, reference(pool, q, q_lens), dtype)


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4)])
def test_prefill_mixed_fp32(heads: int, kv_heads: int, block_size: int) -> None:
    # whole prompt; chunk after a cached prefix; decode rows (one on a block boundary);
    # a one-token prompt; a chunk crossing many key tiles; a sequence without query rows
    ctx = [20, 37, 16, 1, 90, 8]
    q_lens = [20, 5, 1, 1, 70, 0]
    pool = Pool(ctx, kv_heads, 32, block_size, torch.float32, seed=5)
    prefill(pool, q_lens, heads, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_half(dtype: torch.dtype) -> None:
    prefill(Pool([33, 48, 5], 2, 64, 16, dtype, seed=6), [33, 16, 1], 8, dtype)


def test_prefill_odd_head_dim_and_group() -> None:
    prefill(Pool([12, 30], 2, 24, 16, torch.float32, seed=7), [12, 3], 6, torch.float32)


def test_prefill_decode_rows_match_decode() -> None:
    pool = Pool([1, 17, 64], 2, 32, 16, torch.float32, seed=8)
    q = torch.randn((3, 8, 32), generator=pool.gen).to(DEVICE)
    k, v, tables, lens = pool.dev()
    cu = torch.arange(4, dtype=torch.int32, device=DEVICE)
    a = ta.paged_decode(q, k, v, tables, lens, SCALE, torch.empty_like(q), num_splits=2)
    b = ta.paged_prefill(q, k, v, tables, cu, lens, 1, SCALE, torch.empty_like(q))
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_empty_batches() -> None:
    k = torch.zeros((2, 16, 1, 16), device=DEVICE)
    q = torch.zeros((0, 2, 16), device=DEVICE)
    tables = torch.zeros((0, 1), dtype=torch.int32, device=DEVICE)
    lens = torch.zeros((0,), dtype=torch.int32, device=DEVICE)
    cu = torch.zeros((1,), dtype=torch.int32, device=DEVICE)
    assert ta.paged_decode(q, k, k, tables, lens, SCALE, q).shape == (0, 2, 16)
    assert ta.paged_prefill(q, k, k, tables, cu, lens, 0, SCALE, q).shape == (0, 2, 16)


def _decode_args() -> dict[str, object]:
    k = torch.zeros((4, 16, 2, 16))
    return {
        "q": torch.zeros((3, 4, 16)),
        "k_cache": k,
        "v_cache": k.clone(),
        "block_tables": torch.zeros((3, 2), dtype=torch.int32),
        "context_lens": torch.ones((3,), dtype=torch.int32),
        "scale": SCALE,
        "out": torch.zeros((3, 4, 16)),
    }


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("q", torch.zeros((3, 4, 16), dtype=torch.float64), "q must be float32"),
        ("q", torch.zeros((3, 64)), "q must be"),
        ("q", torch.zeros((3, 3, 16)), "not a multiple"),
        ("k_cache", torch.zeros((4, 16, 2, 8)), "k_cache"),
        ("k_cache", torch.zeros((4, 2, 16, 16)).transpose(1, 2), "k_cache"),
        ("v_cache", torch.zeros((4, 16, 2, 16), dtype=torch.bfloat16), "v_cache"),
        ("v_cache", torch.zeros((5, 16, 2, 16)), "v_cache"),
        ("block_tables", torch.zeros((3, 2), dtype=torch.int64), "block_tables"),
        ("block_tables", torch.zeros((2, 2), dtype=torch.int32), "block_tables"),
        ("context_lens", torch.ones((3,), dtype=torch.int64), "context_lens"),
        ("context_lens", torch.ones((4,), dtype=torch.int32), "context_lens"),
        ("out", torch.zeros((3, 4, 16), dtype=torch.float16), "out"),
        ("out", torch.zeros((3, 4, 32))[..., ::2], "out"),
    ],
)
def test_decode_rejects(name: str, value: torch.Tensor, match: str) -> None:
    args = _decode_args()
    args[name] = value
    with pytest.raises(ValueError, match=match):
        ta.paged_decode(**args)  # type: ignore[arg-type]


def test_decode_rejects_num_splits() -> None:
    with pytest.raises(ValueError, match="num_splits"):
        ta.paged_decode(**_decode_args(), num_splits=0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cu", "max_q", "match"),
    [
        (torch.tensor([0, 1, 2, 3], dtype=torch.int64), 1, "cu_seqlens_q"),
        (torch.tensor([0, 1, 2], dtype=torch.int32), 1, "block_tables"),
        (torch.tensor([0, 1, 2, 3], dtype=torch.int32), -1, "max_seqlen_q"),
    ],
)
def test_prefill_rejects(cu: torch.Tensor, max_q: int, match: str) -> None:
    a = _decode_args()
    with pytest.raises(ValueError, match=match):
        ta.paged_prefill(
            a["q"], a["k_cache"], a["v_cache"], a["block_tables"], cu,  # type: ignore[arg-type]
            a["context_lens"], max_q, SCALE, a["out"],  # type: ignore[arg-type]
        )  # fmt: skip


def test_imports_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "from tokenrelay.engine.kernels import triton_attention as ta\n"
        "assert not ta.HAVE_TRITON and not ta.available()\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
