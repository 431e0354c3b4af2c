"""Choosing an attention backend: names, devices, dtypes, block sizes, clear errors."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
import torch

from tokenrelay.core.options import add_engine_options
from tokenrelay.engine.attention import registry
from tokenrelay.engine.config import EngineConfig

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_FLASH = importlib.util.find_spec("flash_attn") is not None


def test_auto_on_a_cpu() -> None:
    assert registry.choose("auto", "cpu", "float32") == "cpu"
    assert registry.choose("auto", "cpu", "bfloat16") == "torch"  # the C kernel is fp32 only


def test_auto_on_cuda_prefers_flash_attn_then_triton() -> None:
    expected = "flash-attn" if HAS_FLASH else ("triton" if HAS_TRITON else "torch")
    assert registry.choose("auto", "cuda", "bfloat16") == expected
    # flash-attn has no fp32 kernels: auto does not pick it there
    assert registry.choose("auto", "cuda", "float32") == ("triton" if HAS_TRITON else "torch")


@pytest.mark.parametrize(
    ("name", "device", "dtype", "message"),
    [
        ("vulkan", "cpu", "float32", "attention_backend must be one of"),
        ("cpu", "cuda", "bfloat16", "runs on the CPU in float32"),
        ("cpu", "cpu", "bfloat16", "runs on the CPU in float32"),
        ("flash-attn", "cpu", "float32", "needs a CUDA device"),
    ],
)
def test_a_backend_that_cannot_run_there_is_a_value_error(
    name: str, device: str, dtype: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        registry.choose(name, device, dtype)


def test_flash_attn_missing_or_fp32_is_named() -> None:
    message = "computes in bfloat16" if HAS_FLASH else "flash_attn package is not installed"
    dtype = "float32" if HAS_FLASH else "bfloat16"
    with pytest.raises(ValueError, match=message):
        registry.choose("flash-attn", "cuda", dtype)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_on_a_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        registry.choose("triton", "cpu", "float32")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registry.choose("triton", "cpu", "float32") == "triton"
    assert registry.choose("triton", "cuda", "bfloat16") == "triton"


def test_block_sizes() -> None:
    assert registry.block_size_for("triton", None) == 16
    assert registry.block_size_for("triton", 256) == 256
    assert registry.block_size_for("cpu", 4) == 4
    # flash-attn sets its own, and refuses one its paged kernels cannot use
    assert registry.block_size_for("flash-attn", None) == 256
    assert registry.block_size_for("flash-attn", 512) == 512
    with pytest.raises(ValueError, match="multiple of 256, got 16"):
        registry.block_size_for("flash-attn", 16)


def test_every_backend_is_created_where_it_runs() -> None:
    cpu = torch.device("cpu")
    for name in ("cpu", "torch"):
        backend = registry.create(name, cpu, torch.float32)
        assert backend.name == name and not backend.graph_safe
    with pytest.raises(ValueError, match="not a resolved backend"):
        registry.create("auto", cpu, torch.float32)


def test_engine_config_checks_the_name_and_the_switch() -> None:
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="xformers")
    with pytest.raises(ValueError, match="enforce_eager must be a boolean"):
        EngineConfig(enforce_eager="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flash-attn needs a CUDA device"):
        EngineConfig(device="cpu", attention_backend="flash-attn")  # before any worker starts
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        EngineConfig(block_size=48)
    config = EngineConfig()
    assert config.block_size is None and config.attention_backend == "auto"


def test_the_cli_offers_the_registry_names(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    actions = {a.dest: a for a in parser._actions}
    assert tuple(actions["attention_backend"].choices or ()) == registry.BACKENDS
    args = parser.parse_args([])
    assert args.max_num_batched_tokens is None  # the engine's per-device default
    assert args.block_size is None and args.enforce_eager is False and args.dtype == "auto"
    monkeypatch.setenv("TOKENRELAY_ATTENTION_BACKEND", "torch")
    monkeypatch.setenv("TOKENRELAY_ENFORCE_EAGER", "1")
    monkeypatch.setenv("TOKENRELAY_BLOCK_SIZE", "32")
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args([])
    assert (args.attention_backend, args.enforce_eager, args.block_size) == ("torch", True, 32)
