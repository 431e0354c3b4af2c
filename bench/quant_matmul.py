"""The GGUF-quantized matmul kernel against fp32 products, on the default model's shapes.

For each weight shape of SmolLM2-135M (q/o 576x576, k/v 192x576, gate/up 1536x576,
down 576x1536, the tied LM head 49152x576; written N x K, ``y = x @ W^T``) and row
counts M = 1, 16, 64, 512, the median time of:

* ``quant``: engine/kernels/quant.py's ``QuantWeight.matmul`` (csrc/quant_matmul.c)
  on the weight in its GGUF format (Q4_1 for the linears, Q8_0 for the LM head: the
  embedding's format), random blocks of that format;
* ``F.linear``: the dequantized fp32 matrix through ``F.linear`` (MKL sgemm);
* ``packed``: the same fp32 matrix reordered once by oneDNN and multiplied through
  engine/kernels/cpu_linear.py (what the engine runs today).

The ratio columns are fp32 time / quant time (above 1: the quant kernel is faster).

    .venv/bin/python -m bench.quant_matmul              # all shapes
    .venv/bin/python -m bench.quant_matmul --quick      # fewer repeats
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import load_average, machine
from tokenrelay.engine.kernels import cpu_linear
from tokenrelay.engine.kernels.quant import QTYPES, QuantWeight, quant_kernel

SHAPES = [  # (name, N, K, qtype)
    ("attn_q/o", 576, 576, "Q4_1"),
    ("attn_k/v", 192, 576, "Q4_1"),
    ("ffn_gate/up", 1536, 576, "Q4_1"),
    ("ffn_down", 576, 1536, "Q4_1"),
    ("lm_head", 49152, 576, "Q8_0"),
]
ROWS = (1, 16, 64, 512)


def random_weight(n: int, k: int, qtype: str, rng: np.random.Generator) -> QuantWeight:
    """Random blocks of ``qtype`` with realistic scales (d ~ 0.01, m ~ -0.1)."""
    _, size = QTYPES[qtype]
    raw = rng.integers(0, 256, size=(n, k // 32, size), dtype=np.uint8)
    raw[..., 0:2] = np.full((n, k // 32), 0.01, np.float16).view(np.uint8).reshape(n, -1, 2)
    if qtype == "Q4_1":
        raw[..., 2:4] = np.full((n, k // 32), -0.1, np.float16).view(np.uint8).reshape(n, -1, 2)
    return QuantWeight(torch.from_numpy(raw.reshape(n, -1)), qtype)


def timed(fn: Callable[[], object], budget_s: float, min_reps: int = 3) -> float:
    """Median seconds of ``fn`` over repeats filling about ``budget_s`` (after a warm-up)."""
    fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < min_reps or (spent < budget_s and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about 4x fewer repeats")
    args = parser.parse_args()
    budget = 0.05 if args.quick else 0.2
    if quant_kernel() is None:
        raise SystemExit("the quant kernel did not build here: nothing to measure")
    packing = cpu_linear.packing_available(torch.device("cpu"), torch.float32)
    rng = np.random.default_rng(0)
    print(f"# {machine()}, torch threads {torch.get_num_threads()}, load {load_average()}")
    print("# median ms per call; ratio = fp32 time / quant time (>1: quant faster)")
    head = f"{'shape':<12} {'N x K':>11} {'qtype':>5} {'M':>4} {'quant':>9} {'F.linear':>9}"
    head += f" {'packed':>9} {'xF.lin':>7} {'xpacked':>7}"
    print(head)
    with torch.inference_mode():
        for name, n, k, qtype in SHAPES:
            w = random_weight(n, k, qtype, rng)
            dense = w.dequantize()
            packed = cpu_linear.pack(dense) if packing else None
            for m in ROWS:
                x = torch.randn(m, k)
                tq = timed(lambda: w.matmul(x), budget)  # noqa: B023
                tf = timed(lambda: F.linear(x, dense), budget)  # noqa: B023
                tp = (
                    timed(lambda: cpu_linear.linear(x, dense, packed), budget)  # noqa: B023
                    if packed is not None
                    else float("nan")
                )
                print(
                    f"{name:<12} {f'{n}x{k}':>11} {qtype:>5} {m:>4} {tq * 1e3:>9.3f} "
                    f"{tf * 1e3:>9.3f} {tp * 1e3:>9.3f} {tf / tq:>7.2f} {tp / tq:>7.2f}"
                )


if __name__ == "__main__":
    main()
