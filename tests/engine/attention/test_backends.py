"""Every attention backend over the paged KV pool against a dense float64 reference."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
from typing import Any

import pytest
import torch

from tokenrelay.engine.attention import registry
from tokenrelay.engine.attention.backend import AttentionBackend
from tokenrelay.engine.attention.cpu_kernel import CpuBackend
from tokenrelay.engine.attention.metadata import (
    _build_decode,
    _build_general,
    build_metadata,
    paged_attention,
    store_kv,
)
from tokenrelay.engine.attention.torch_sdpa import TorchBackend

if not torch.cuda.is_available():  # the Triton kernels run under Triton's CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

BLOCK = 4
CPU = torch.device("cpu")
TORCH = TorchBackend(CPU, torch.float32)


@pytest.fixture(params=["torch", "cpu", "triton"])
def backend(request: pytest.FixtureRequest) -> AttentionBackend:
    """Each CPU case runs through every backend that runs on a CPU."""
    name = request.param
    if name == "cpu" and getattr(registry.create("cpu", CPU, torch.float32), "kernel", 0) is None:
        pytest.skip("the CPU kernel did not build here (no C compiler?)")
    if name == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    return registry.create(name, CPU, torch.float32)


def dense_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` [n, H, D] at positions start.. over k/v [start + n, Hkv, D]
    (a key ``window`` or more before its query hidden; scores soft-capped)."""
    n, heads, _ = q.shape
    groups = heads // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # [L, H, D]
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    qpos = torch.arange(start, start + n)[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    hidden = kpos > qpos
    if window is not None:
        hidden |= kpos <= qpos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def run_case(
    seqs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    seed: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    block_size: int = BLOCK,
    backend: AttentionBackend = TORCH,
    kv_dtype: torch.dtype | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``seqs`` = [(cached prefix length, new tokens)]; returns (paged output, reference).

    ``kv_dtype``: the pool's, if not ``dtype`` (the reference then attends to K/V rounded
    to it). ``window``, ``softcap``: the layer's, as the backends take them."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    need = [-(-(start + n) // block_size) for start, n in seqs]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    rnd.shuffle(ids)
    tables, at = [], 0
    for k in need:
        tables.append(ids[at : at + k])
        at += k
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=kv_dtype or dtype, device=device)
    v_cache = torch.zeros(shape, dtype=kv_dtype or dtype, device=device)
    # full K/V history per sequence; write the cached prefixes first
    hist = [
        (
            torch.randn(start + n, kv_heads, head_dim, generator=gen),
            torch.randn(start + n, kv_heads, head_dim, generator=gen),
        )
        for start, n in seqs
    ]
    with_prefix = [i for i, (start, _) in enumerate(seqs) if start > 0]
    if with_prefix:
        meta = build_metadata(
            [seqs[i][0] for i in with_prefix],
            [0] * len(with_prefix),
            [tables[i] for i in with_prefix],
            block_size=block_size,
            device=torch.device(device),
            backend=backend,
        )
        k_pre = torch.cat([hist[i][0][: seqs[i][0]] for i in with_prefix]).to(device, dtype)
        v_pre = torch.cat([hist[i][1][: seqs[i][0]] for i in with_prefix]).to(device, dtype)
        store_kv(k_pre, v_pre, k_cache, v_cache, meta.slot_mapping)
    meta = build_metadata(
        [n for _, n in seqs],
        [start for start, _ in seqs],
        tables,
        block_size=block_size,
        device=torch.device(device),
        backend=backend,
    )
    qs = [torch.randn(n, heads, head_dim, generator=gen) for _, n in seqs]
    q = torch.cat(qs).to(device, dtype)
    k_new = torch.cat([h[0][start:] for h, (start, _) in zip(hist, seqs, strict=True)])
    v_new = torch.cat([h[1][start:] for h, (start, _) in zip(hist, seqs, strict=True)])
    scale = head_dim**-0.5
    out = paged_attention(
        q, k_new.to(device, dtype), v_new.to(device, dtype), k_cache, v_cache, meta, scale,
        window, softcap,
    )  # fmt: skip
    if kv_dtype is not None:  # what the pool holds
        hist = [(k.to(kv_dtype).float(), v.to(kv_dtype).float()) for k, v in hist]
    ref = torch.cat(
        [
            dense_reference(qi, h[0], h[1], start, scale, window, softcap)
            for qi, h, (start, _) in zip(qs, hist, seqs, strict=True)
        ]
    )
    return out.float().cpu(), ref


@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 1)],  # first token
        [(0, 9)],  # plain prefill
        [(5, 1), (17, 1), (3, 1), (40, 1)],  # all decode, ragged contexts
        [(6, 7), (0, 11)],  # chunked prefill with a cached prefix, and a fresh one
        [(12, 1), (0, 5), (9, 1), (4, 6), (30, 1)],  # mixed prefill and decode
        [(i * 7 % 45, 1) for i in range(20)] + [(0, 6), (10, 3)],  # several decode buckets
        [(30, 40), (0, 37), (3, 1)],  # prefill chunks longer than a tile of rows, with decode
    ],
)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (9, 3), (8, 1)])
def test_paged_attention_matches_dense(
    seqs: list[tuple[int, int]], heads: int, kv_heads: int, backend: AttentionBackend
) -> None:
    out, ref = run_case(
        seqs, heads, kv_heads, head_dim=16, seed=len(seqs) * 31 + heads, backend=backend
    )
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("head_dim", [64, 48])
def test_long_prefill_chunks_match_dense(head_dim: int, backend: AttentionBackend) -> None:
    """Chunks of ~100 tokens on long cached prefixes: many tiles of rows, many sub-tiles of
    keys per block, the causal mask cutting through them."""
    seqs = [(150, 100), (0, 90), (77, 33)]
    out, ref = run_case(seqs, 8, 2, head_dim=head_dim, seed=head_dim, block_size=16,
                        backend=backend)  # fmt: skip
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("seed", range(12))
def test_paged_attention_random_shapes(seed: int, backend: AttentionBackend) -> None:
    rnd = random.Random(seed)
    kv_heads = rnd.choice([1, 2, 3])
    heads = kv_heads * rnd.choice([1, 2, 3, 4])
    seqs = [
        (rnd.choice([0, rnd.randrange(1, 50)]), rnd.choice([1, 1, rnd.randrange(1, 20)]))
        for _ in range(rnd.randrange(1, 7))
    ]
    out, ref = run_case(
        seqs,
        heads,
        kv_heads,
        head_dim=rnd.choice([8, 20, 32, 64, 128] if backend.name != "triton" else [16, 32, 64]),
        seed=seed,
        block_size=rnd.choice([BLOCK, 16]),
        backend=backend,
    )
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    ("window", "softcap"), [(8, None), (1, None), (None, 2.0), (5, 3.0), (100, None)]
)
@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 23)],  # a prefill longer than the window
        [(3, 1), (17, 1), (40, 1), (9, 1)],  # decode rows, some within the window
        [(12, 1), (0, 5), (30, 9), (4, 6), (25, 1)],  # mixed, chunks on cached prefixes
        [(i * 7 % 45, 1) for i in range(20)] + [(0, 21)],  # several decode buckets
    ],
)
@pytest.mark.parametrize("head_dim", [16, 24])  # the C prefill tiles: vector rows, or not
def test_sliding_window_and_softcap_match_dense(
    seqs: list[tuple[int, int]],
    window: int | None,
    softcap: float | None,
    head_dim: int,
    backend: AttentionBackend,
) -> None:
    """A local layer's window (a row at position p sees keys p - window + 1 .. p, the blocks
    before it too) and soft-capped scores (Gemma 2), through every CPU backend."""
    seed = len(seqs) + (window or 0)
    out, ref = run_case(seqs, 6, 2, head_dim=head_dim, seed=seed, backend=backend,
                        window=window, softcap=softcap)  # fmt: skip
    assert (out - ref).abs().max().item() < 1e-5
    full, _ = run_case(seqs, 6, 2, head_dim=head_dim, seed=seed, backend=backend)
    if (window is not None and window < 30) or softcap is not None:
        assert (out - full).abs().max().item() > 1e-3  # the window or the cap matters here


def test_softcapped_rows_in_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path holds the fp32 scores of SOFTCAP_ROWS query rows at a time."""
    from tokenrelay.engine.attention import torch_sdpa

    monkeypatch.setattr(torch_sdpa, "SOFTCAP_ROWS", 5)
    seqs = [(12, 1), (0, 23), (9, 1), (30, 17)]
    for b in (TORCH, CpuBackend(CPU, torch.float32, None)):
        out, ref = run_case(seqs, 6, 2, 16, seed=9, backend=b, window=6, softcap=2.0)
        assert (out - ref).abs().max().item() < 1e-5


def _same(a: Any, b: Any) -> bool:
    """Equal values, dtypes and shapes, through the plan dataclasses too."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            _same(getattr(a, f.name), getattr(b, f.name))
            for f in dataclasses.fields(a)
            if f.name != "backend"
        )
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


@pytest.mark.parametrize("plan", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_decode_batches_build_what_the_general_path_builds(
    seed: int, plan: bool, backend: AttentionBackend
) -> None:
    """All-decode batches take a shortcut past numpy; its metadata is the same."""
    rnd = random.Random(seed)
    block_size = rnd.choice([1, BLOCK, 16])
    starts = [rnd.randrange(0, 90) for _ in range(rnd.choice([1, 1, 3, 20]))]
    tables = [
        rnd.sample(range(200), -(-(s + 1) // block_size) + rnd.choice([0, 0, 2])) for s in starts
    ]
    args = ([1] * len(starts), starts, tables)
    kw: dict[str, Any] = dict(block_size=block_size, device=CPU, backend=backend)
    fast = build_metadata(*args, **kw, plan=plan)
    decode, host_d = _build_decode(starts, tables, block_size, CPU, backend)
    general, host_g = _build_general(*args, block_size, CPU, backend)
    if plan and backend.needs_plan:
        backend.plan(decode, host_d())
        backend.plan(general, host_g())
    assert _same(fast, decode)
    assert _same(fast, general)
    tables[-1] = tables[-1][: starts[-1] // block_size]  # one block short
    with pytest.raises(ValueError, match=r"block_table: .* cannot hold"):
        build_metadata(*args, **kw, plan=plan)


def test_block_table_too_short_is_rejected() -> None:
    with pytest.raises(ValueError, match="block_table"):
        build_metadata([5], [8], [[0, 1, 2]], block_size=4, device=CPU, backend=TORCH)


def test_slot_mapping_follows_block_table() -> None:
    meta = build_metadata(
        [3, 1],
        [2, 5],
        [[7, 2], [4, 9]],
        block_size=4,
        device=CPU,
        backend=TORCH,
    )
    # seq 0: positions 2, 3 (block 7), 4 (block 2); seq 1: position 5 (block 9, offset 1)
    assert meta.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0, 9 * 4 + 1]
    assert meta.positions.tolist() == [2, 3, 4, 5]
    assert meta.context_lens.tolist() == [5, 6]
    assert meta.cu_seqlens_q.tolist() == [0, 3, 4]
    assert not meta.all_decode


@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 9)],
        [(5, 1), (17, 1), (3, 1), (40, 1)],
        [(12, 1), (0, 5), (9, 1), (4, 6), (30, 1)],
        [(30, 40), (0, 37), (3, 1)],
    ],
)
def test_a_float16_pool_under_float32_compute(
    seqs: list[tuple[int, int]], backend: AttentionBackend
) -> None:
    """The cpu and torch backends read fp16 K/V into fp32: the float64 answer over the
    values the pool holds, whichever path (decode kernel, gather, chunk) read them. Triton
    reads the pool in the compute dtype only, and says so."""
    if backend.name == "triton":
        with pytest.raises(ValueError, match="dtype"):
            run_case(seqs, 8, 2, 16, seed=3, backend=backend, kv_dtype=torch.float16)
        return
    for b in (backend, CpuBackend(CPU, torch.float32, None)):
        out, ref = run_case(seqs, 8, 2, head_dim=32, seed=len(seqs), block_size=16, backend=b,
                            kv_dtype=torch.float16)  # fmt: skip
        assert (out - ref).abs().max().item() < 1e-5
        out, ref = run_case(seqs, 8, 2, head_dim=32, seed=len(seqs), block_size=16, backend=b,
                            kv_dtype=torch.float16, window=7, softcap=4.0)  # fmt: skip
        assert (out - ref).abs().max().item() < 1e-5


def test_the_cpu_backend_without_its_kernel_is_the_torch_path() -> None:
    """No compiler (or TOKENRELAY_CPU_KERNELS=0): the cpu backend still attends, via SDPA."""
    seqs = [(12, 1), (0, 5), (9, 1)]
    out, ref = run_case(seqs, 4, 2, 16, seed=5, backend=CpuBackend(CPU, torch.float32, None))
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch", "triton", "flash-attn"])
def test_cuda_paged_attention_matches_dense(name: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    try:
        name = registry.choose(name, "cuda", "bfloat16")
    except ValueError as exc:
        pytest.skip(str(exc))
    seqs = [(300, 1), (0, 40), (270, 20), (700, 1)]
    out, ref = run_case(
        seqs,
        8,
        2,
        64,
        seed=0,
        device="cuda",
        dtype=torch.bfloat16,
        block_size=registry.block_size_for(name, None),
        backend=registry.create(name, torch.device("cuda"), torch.bfloat16),
    )
    assert (out - ref).abs().max().item() < 3e-2
    out, ref = run_case(
        seqs, 8, 2, 64, seed=1, device="cuda", dtype=torch.bfloat16,
        block_size=registry.block_size_for(name, None),
        backend=registry.create(name, torch.device("cuda"), torch.bfloat16),
        window=100, softcap=5.0,
    )  # fmt: skip
    assert (out - ref).abs().max().item() < 3e-2
