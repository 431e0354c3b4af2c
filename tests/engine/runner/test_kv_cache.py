"""The KV pool (engine/runner/kv_cache.py): sized in tokens of the model's KV on the CPU,
capped by the memory available, and resident only as blocks are used."""

from __future__ import annotations

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


def test_the_cpu_default_holds_the_default_tokens_whatever_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_cache, "available_memory", lambda: 64 * 2**30)
    for cfg in (config(), config(layers=30, kv_heads=3), config(layers=2, kv_heads=1)):
        blocks = plan_num_blocks(cfg, block_size=16, dtype=torch.float32, device=CPU)
        assert blocks * 16 == kv_cache.CPU_DEFAULT_TOKENS


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


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_an_unused_pool_costs_no_memory() -> None:
    cfg = config()  # 64 KiB of fp32 KV a token
    before = _rss()
    cache = KVCache(cfg, num_blocks=512, block_size=16, dtype=torch.float32, device=CPU)
    assert cache.data.numel() * 4 == 512 * 2**20  # a 512 MiB pool
    assert _rss() - before < 64 * 2**20
    assert not cache.data[0, 0, 3].any() and not cache.data[-1, 1, -1].any()  # zeroed
    cache.k[0][5].fill_(1.0)  # a block in use is real memory
    assert cache.data[0, 0, 5].sum() == 16 * 8 * 64 and not cache.data[0, 0, 4].any()
    assert cache.data.dtype == torch.float32 and cache.data.is_contiguous()
    half = KVCache(cfg, num_blocks=2, block_size=16, dtype=torch.bfloat16, device=CPU)
    assert half.data.dtype == torch.bfloat16 and not half.data.any()
