"""oneDNN-packed projections (engine.kernels.cpu_linear) against ``F.linear``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenrelay.engine.kernels import cpu_linear
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.weights import load_model

CPU = torch.device("cpu")
from tests.root import ROOT  # noqa: E402

pytestmark = pytest.mark.skipif(
    not cpu_linear.packing_available(CPU, torch.float32), reason="PyTorch built without oneDNN"
)


@pytest.mark.parametrize("rows", [1, 3, 64, 257, 1100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_matches_dense(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(960, 576, generator=gen) * 0.05
    bias = torch.randn(960, generator=gen) if with_bias else None
    x = torch.randn(rows, 576, generator=gen)
    packed = cpu_linear.pack(weight)
    got = cpu_linear.linear(x, cpu_linear.placeholder(weight), packed, bias)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_non_contiguous_input() -> None:
    weight = torch.randn(64, 32)
    x = torch.randn(32, 10).t()  # [10, 32], column-major
    got = cpu_linear.linear(x, weight, cpu_linear.pack(weight))
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_unpacked_path_is_plain_linear() -> None:
    weight, x = torch.randn(8, 4), torch.randn(2, 4)
    assert torch.equal(cpu_linear.linear(x, weight, None), F.linear(x, weight))


def test_availability_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not cpu_linear.packing_available(CPU, torch.bfloat16)
    assert not cpu_linear.packing_available(torch.device("meta"), torch.float32)
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "0")
    assert not cpu_linear.packing_available(CPU, torch.float32)


def test_loaded_model_is_packed_and_env_turns_it_off(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = ModelConfig.from_pretrained(model_path)
    packed = load_model(model_path, cfg, CPU, torch.float32)
    layer = packed.layers[0]
    assert packed.head_packed is not None and layer.mlp.down_packed is not None
    assert layer.mlp.down_weight.numel() == 0  # the dense copy is released
    assert packed.embed.numel() == cfg.vocab_size * cfg.hidden_size  # tied: lookup stays dense
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "off")
    dense = load_model(model_path, cfg, CPU, torch.float32)
    assert dense.head_packed is None and dense.layers[0].mlp.down_packed is None
    hidden = torch.randn(5, cfg.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(
            packed.compute_logits(hidden), dense.compute_logits(hidden), rtol=1e-4, atol=1e-4
        )


RSS_PROBE = """
import gc, torch
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.store import resolve_model
from tokenrelay.engine.models.weights import load_model
path = resolve_model("default")
model = load_model(path, ModelConfig.from_pretrained(path), torch.device("cpu"), torch.float32)
gc.collect()
status = open("/proc/self/status").read()
print(int(status.split("VmRSS:")[1].split()[0]) // 1024)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_packed_weights_replace_the_dense_ones_in_memory(model_path: Path) -> None:
    """Packed, a worker holds about one extra LM head (113 MiB), not a second model."""

    def rss_mib(switch: str) -> int:
        env = {**os.environ, cpu_linear.ENV_SWITCH: switch, "HF_HUB_OFFLINE": "1"}
        out = subprocess.run(
            [sys.executable, "-c", RSS_PROBE],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        return int(out.stdout.strip().splitlines()[-1])

    dense, packed = rss_mib("0"), rss_mib("1")
    assert packed < dense + 250, (dense, packed)  # 496 MiB more when the mapping was kept
