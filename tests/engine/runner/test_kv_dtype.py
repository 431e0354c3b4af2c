"""The KV pool's dtype (``kv_cache_dtype``): float16 by default under the fused CPU decoder,
the compute dtype elsewhere; an explicit one checked against the attention backend before
anything loads; and the default model's greedy tokens over a float16 pool against a float32
one, with the fused decoder and without it."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.engine.models.test_gguf_weights import _greedy as greedy
from tests.engine.models.test_kquant_model import _top
from tokenrelay.core.cli import build_parser
from tokenrelay.core.serve import worker_command
from tokenrelay.engine import EngineConfig, LLMEngine
from tokenrelay.engine.attention.registry import kv_cache_dtype
from tokenrelay.engine.runner import model_runner
from tokenrelay.engine.runner.devices import kv_dtype_name
from tokenrelay.engine.runner.model_runner import ModelRunner
from tokenrelay.worker.engine_client import engine_config

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8, 13,",
    "Q: What is the boiling point of water?\nA:",
    "The three laws of thermodynamics are",
]
TOKENS = 32
# Where the greedy tokens of the two pools part, the float32 run's best two tokens are this
# close (log-probs): rounding K/V to float16 moves the logits by about 1e-3 of their range.
NEAR_TIE = 0.1


def _engine(weights: str, kv: str) -> Any:
    """The default model on the CPU, ``weights`` as asked, its runner's pool in ``kv``."""
    config = EngineConfig(model="default", device="cpu", weights=weights, num_blocks=256,
                          kv_cache_dtype=kv)  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:  # the runner built with the config's KV dtype
        mp.setattr(model_runner, "ModelRunner", functools.partial(ModelRunner, kv_cache_dtype=kv))
        return LLMEngine(config)


@pytest.fixture(scope="module", params=["native", "fp32"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    """(float16 pool, float32 pool) engines: the fused decoder (native GGUF blocks) or the
    op-by-op decoder with the cpu attention backend (dense fp32 weights)."""
    yield _engine(request.param, "float16"), _engine(request.param, "float32")


def _greedy(engine: Any, prompts: list[str]) -> list[list[int]]:
    return greedy(engine, prompts, TOKENS)


def test_the_pools_dtypes(pair: tuple[Any, Any]) -> None:
    half, full = pair
    assert half.runner.kv_cache.data.dtype == torch.float16
    assert full.runner.kv_cache.data.dtype == torch.float32
    assert half.runner.kv_cache.data.nbytes * 2 == full.runner.kv_cache.data.nbytes
    fused = half.runner.weights == "native"
    assert (half.runner.model.fused is not None) == fused
    assert (full.runner.model.fused is not None) == fused


def test_greedy_tokens_agree_up_to_near_ties(pair: tuple[Any, Any]) -> None:
    """Greedy tokens over a float16 pool equal the float32 pool's; where they part, the
    float32 run's best two tokens were within NEAR_TIE and the float16 run took the other."""
    half, full = pair
    prompts = [list(full.tokenizer(p)["input_ids"]) for p in PROMPTS]
    got, want = _greedy(half, prompts), _greedy(full, prompts)
    parted = [next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
              for g, w in zip(got, want, strict=True)]  # fmt: skip
    where = f"first differences (token index per prompt, None: none): {parted}"
    assert all(len(g) == TOKENS for g in got), where
    for ids, g, w, i in zip(prompts, got, want, parted, strict=True):
        if i is None:
            continue
        top = _top(full, ids + w[:i])  # the float32 run where the two parted
        options = {t.raw: t.logprob for t in top.top[:2]}
        chosen = full.token_texts(g[i])[1]
        assert chosen in options, (where, i, chosen, options)
        assert top.top[0].logprob - top.top[1].logprob <= NEAR_TIE, (where, i, options)
    assert parted.count(None) >= len(PROMPTS) // 2, where


def test_auto_is_float16_only_under_the_fused_decoder() -> None:
    assert kv_cache_dtype("auto", "cpu", "float32", fused=True) == "float16"
    assert kv_cache_dtype("auto", "cpu", "float32") == "float32"
    assert kv_cache_dtype("auto", "triton", "bfloat16") == "bfloat16"
    assert kv_cache_dtype("auto", "flash-attn", "float16") == "float16"


def test_explicit_dtypes_each_backend_reads() -> None:
    for backend in ("cpu", "torch"):
        assert kv_cache_dtype("float16", backend, "float32") == "float16"
        assert kv_cache_dtype("float32", backend, "float32") == "float32"
    assert kv_cache_dtype("bfloat16", "triton", "bfloat16") == "bfloat16"
    assert kv_cache_dtype("float16", "flash-attn", "float16") == "float16"
    refused = [("float16", "triton", "float32"), ("bfloat16", "cpu", "float32"),
               ("float16", "flash-attn", "bfloat16"), ("float32", "triton", "bfloat16"),
               ("bfloat16", "torch", "float16")]  # fmt: skip
    for requested, backend, dtype in refused:
        with pytest.raises(ValueError, match=f"kv_cache_dtype={requested} does not run with"):
            kv_cache_dtype(requested, backend, dtype)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_cache_dtype("int8", "cpu", "float32")


def test_the_config_checks_the_dtype() -> None:
    assert EngineConfig().kv_cache_dtype == "auto"
    assert EngineConfig(device="cpu", kv_cache_dtype="fp16").kv_cache_dtype == "float16"
    assert EngineConfig(device="cpu", kv_cache_dtype="FLOAT32").kv_cache_dtype == "float32"
    EngineConfig(device="cpu", attention_backend="torch", kv_cache_dtype="float16")
    for bad in ("int8", 16, None):
        with pytest.raises(ValueError, match="kv_cache_dtype must be auto, float32, float16"):
            EngineConfig(kv_cache_dtype=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bfloat16 only where the model computes in bfloat16"):
        EngineConfig(device="cpu", kv_cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype=float16 does not run with"):
        EngineConfig(device="cpu", weights="bf16", kv_cache_dtype="float16")
    EngineConfig(device="cpu", weights="bf16", kv_cache_dtype="bfloat16")


def test_the_runner_refuses_a_pool_its_backend_cannot_read_before_loading(model_path: Any,
                                                                          ) -> None:  # fmt: skip
    with pytest.raises(ValueError, match="kv_cache_dtype=bfloat16 does not run with"):
        ModelRunner(model_path, device="cpu", kv_cache_dtype="bfloat16", num_blocks=4)
    with pytest.raises(ValueError, match="kv_cache_dtype: 'int8' is not supported"):
        ModelRunner(model_path, device="cpu", kv_cache_dtype="int8", num_blocks=4)
    assert kv_dtype_name(None) == kv_dtype_name("auto") == "auto"
    assert kv_dtype_name("half") == kv_dtype_name(torch.float16) == "float16"


def test_the_cli_flag_reaches_the_config_and_the_worker() -> None:
    args = build_parser().parse_args(["worker", "--device", "cpu"])
    assert engine_config(args).kv_cache_dtype == "auto"
    args = build_parser().parse_args(["worker", "--device", "cpu", "--kv-cache-dtype", "float32"])
    assert engine_config(args).kv_cache_dtype == "float32"
    cmd = worker_command(build_parser().parse_args(["serve", "--kv-cache-dtype", "float16"]))
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "float16"
