"""The KV pool (engine/runner/kv_cache.py): sized in tokens of the model's KV on the CPU,
capped by the memory available, and resident only as blocks are used."""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from pathlib import Path

import pytest
import torch

from tokenrelay.engine.models.config import ModelConfig, RopeConfig
from tokenrelay.engine.runner import kv_cache
from tokenrelay.engine.runner.kv_cache import KVCache, block_bytes, plan_num_blocks

CPU = torch.device("cpu")


def config(layers: int = 16, kv_heads: int = 8, head_dim: int = 64) -> ModelConfig:
    return ModelConfig(
        model_type="llama", vocab_size=100, hidden_size=512, num_layers=layers, num_heads=8,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=1024, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0), max_position_embeddings=4096,
        tie_word_embeddings=True,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_cpu_default_holds_the_default_tokens_whatever_the_model(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    monkeypatch.setattr(kv_cache, "available_memory", lambda: 64 * 2**30)
    for cfg in (config(), config(layers=30, kv_heads=3), config(layers=2, kv_heads=1)):
        blocks = plan_num_blocks(cfg, block_size=16, dtype=dtype, device=CPU)
        assert blocks * 16 == kv_cache.CPU_DEFAULT_TOKENS


def test_a_float16_pool_takes_half_the_bytes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same tokens in half the memory; the same memory share holds twice the tokens."""
    cfg = config()
    assert block_bytes(cfg, 16, torch.float16) * 2 == block_bytes(cfg, 16, torch.float32)
    monkeypatch.setattr(kv_cache, "available_memory", lambda: 64 * 2**30)
    with caplog.at_level(logging.INFO, logger="tokenrelay.engine"):
        plan_num_blocks(cfg, block_size=16, dtype=torch.float16, device=CPU)
    sized = next(r for r in caplog.records if r.getMessage() == "KV pool sized")
    assert sized.__dict__["dtype"] == "float16" and sized.__dict__["gib"] == 0.5  # fp32: 1 GiB
    per_block = block_bytes(cfg, 16, torch.float32)
    monkeypatch.setattr(kv_cache, "available_memory", lambda: 100 * per_block)
    capped = {d: plan_num_blocks(cfg, block_size=16, dtype=d, device=CPU)
              for d in (torch.float32, torch.float16)}  # fmt: skip
    assert capped[torch.float16] == 2 * capped[torch.float32]
    cache = KVCache(cfg, num_blocks=4, block_size=16, dtype=torch.float16, device=CPU)
    assert cache.data.dtype == torch.float16 and cache.data.nbytes == 4 * per_block // 2


def test_the_cpu_default_takes_at_most_a_share_of_available_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = config()
    per_block = block_bytes(cfg, 16, torch.float32)
    monkeypatch.setattr(kv_cache, "available_memory", lambda: 100 * per_block)
    blocks = plan_num_blocks(cfg, block_size=16, dtype=torch.float32, device=CPU)
    assert blocks == int(100 * kv_cache.CPU_MEMORY_SHARE)
    monkeypatch.setattr(kv_cache, "available_memory", lambda: None)  # not Linux: the default
    assert plan_num_blocks(cfg, block_size=16, dtype=torch.float32, device=CPU) * 16 == 16384
    # explicit sizes win
    assert plan_num_blocks(cfg, block_size=16, dtype=torch.float32, device=CPU,
                           num_blocks=7) == 7  # fmt: skip
    gib = plan_num_blocks(cfg, block_size=16, dtype=torch.float32, device=CPU,
                          kv_cache_memory_gib=per_block * 3 / 2**30)  # fmt: skip
    assert gib == 3


def _grain() -> int:
    """The OS's unit of fresh memory for a large zeroed allocation: a transparent huge page
    where the kernel gives them to those that ask (numpy asks for its large arrays)."""
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    try:
        if "[never]" in (thp / "enabled").read_text():
            return mmap.PAGESIZE
        return int((thp / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return mmap.PAGESIZE


def _resident(t: torch.Tensor) -> int:
    """Bytes of ``t``'s memory the OS has mapped in (mincore(2) over its pages)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec) * page


@pytest.mark.skipif(sys.platform != "linux", reason="mincore(2) as Linux has it")
def test_an_unused_pool_costs_no_memory() -> None:
    cfg = config()  # 64 KiB of fp32 KV a token
    cache = KVCache(cfg, num_blocks=512, block_size=16, dtype=torch.float32, device=CPU)
    assert cache.data.numel() * 4 == 512 * 2**20  # a 512 MiB pool
    assert _resident(cache.data) < 2**20
    assert not cache.data[0, 0, 3].any() and not cache.data[-1, 1, -1].any()  # zeroed
    cache.k[0][5].fill_(1.0)  # a block in use is real memory
    assert cache.data[0, 0, 5].sum() == 16 * 8 * 64 and not cache.data[0, 0, 4].any()
    # the block, and the pages (huge ones, where the OS gives them) that the reads mapped
    assert 2**15 <= _resident(cache.data) < 2**20 + 3 * max(_grain(), 2**15)
    assert cache.data.dtype == torch.float32 and cache.data.is_contiguous()
    half = KVCache(cfg, num_blocks=2, block_size=16, dtype=torch.bfloat16, device=CPU)
    assert half.data.dtype == torch.bfloat16 and not half.data.any()


@pytest.mark.skipif(sys.platform != "linux", reason="mincore(2) as Linux has it")
def test_the_switch_makes_the_pool_resident_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kv_cache.LAZY_SWITCH, "0")
    cache = KVCache(config(), num_blocks=64, block_size=16, dtype=torch.float32, device=CPU)
    assert _resident(cache.data) >= 64 * 2**20 - 2 * mmap.PAGESIZE  # written in full
    assert not cache.data.any()
