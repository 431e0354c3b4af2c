"""Which part of a model each tensor-parallel rank holds (torch-free).

Megatron's split of a Llama-family decoder over ``size`` ranks:

- q/k/v and gate/up are column-parallel: rank ``r`` computes the query heads
  ``[r H/size, (r+1) H/size)``, the KV heads ``[r Hkv/size, (r+1) Hkv/size)`` (the same
  GQA groups: query head ``h`` reads KV head ``h // (H/Hkv)``) and the intermediate
  columns ``[r I/size, (r+1) I/size)``;
- o and down are row-parallel: each rank multiplies its own slice of the input
  features and one all-reduce sums the partial outputs (a bias is added once, after);
- the token embedding and the LM head are vocabulary-parallel: rank ``r`` holds the
  rows ``[r Vp, (r+1) Vp)`` with ``Vp = ceil(V / size)`` (the last shard padded with
  zero rows); the embedding lookup is one all-reduce, the logits one all-gather;
- norms, rotary tables and the residual stream are replicated; but q/k norms over the
  whole projections (OLMo 2), whose weights are cut with the heads and whose mean of
  squares is one all-reduce of the ranks' sums (``blocks.split_rms_norms``).

Each rank's KV cache holds only its KV heads; block ids are the same on every rank.
"""

from __future__ import annotations

import dataclasses

from tokenrelay.engine.models.config import ModelConfig


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` naming the counts when ``size`` cannot split this model evenly."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    if size == 1:
        return
    bad = [
        f"{name} ({count})"
        for name, count in (
            ("num_attention_heads", cfg.num_heads),
            ("num_key_value_heads", cfg.num_kv_heads),
            ("intermediate_size", cfg.intermediate_size),
        )
        if count % size
    ]
    if bad:
        raise ValueError(
            f"tensor_parallel_size: {size} does not divide {' and '.join(bad)} "
            f"(the model has {cfg.num_heads} attention heads, {cfg.num_kv_heads} KV heads)"
        )


def vocab_shard(vocab_size: int, size: int) -> int:
    """Rows of the embedding / LM head each rank holds: ``ceil(vocab_size / size)``."""
    return -(-vocab_size // size)


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shapes one rank's modules are built with (heads, intermediate and vocab shares).

    ``head_dim`` stays the model's (it is explicit in :class:`ModelConfig`), and so does
    the softmax scale derived from it.
    """
    check_tensor_parallel(cfg, size)
    if size == 1:
        return cfg
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=cfg.num_kv_heads // size,
        intermediate_size=cfg.intermediate_size // size,
        vocab_size=vocab_shard(cfg.vocab_size, size),
    )
