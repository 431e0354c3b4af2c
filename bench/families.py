"""Each supported model family at about 0.5B parameters: our engine against transformers.

For every ``model_type`` the engine loads (engine/models/families.py), a random-weight
checkpoint of about 0.5B parameters (hidden 1152, 24 layers, 16 query / 4 KV heads of
72, FFN 3072, the default model's tokenizer and its 49,152-token vocabulary) is built
with transformers from a config of that family, saved as bf16 safetensors under
``~/.cache/tokenrelay-bench/families/`` (once; later runs reuse it), and given to
``bench.engine_throughput`` (the same prompts, fp32, greedy, EOS ignored; ours against
transformers ``generate`` with static batches in the same process and thread count).
A summary table of each family's ratio follows the runs.

    .venv/bin/python -m bench.families                        # every family
    .venv/bin/python -m bench.families --families gemma2,phi3 --num-prompts 8

The weights are noise, so the text is; the cost is that of a trained model of the shape.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import ROOT, load_average, machine, say

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

FOLDER = Path.home() / ".cache" / "tokenrelay-bench" / "families"
SHAPE: dict[str, Any] = {
    "hidden_size": 1152,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 72,
    "intermediate_size": 3072,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# what each family adds to the shape (the values of its released checkpoints' configs)
EXTRA: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": {},
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.015625, "logits_scaling": 8.0},
    "olmo2": {},
    "phi3": {"original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75},
    "gemma2": {"query_pre_attn_scalar": 72, "sliding_window": 4096,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"query_pre_attn_scalar": 72, "sliding_window": 512,
                    "rope_local_base_freq": 10000.0},
}  # fmt: skip


def supported() -> list[str]:
    """The families the engine loads, that this bench has a config for."""
    from tokenrelay.engine.models.families import FAMILIES

    return [t for t in EXTRA if t in FAMILIES]


def build(model_type: str, shape: dict[str, Any] | None = None, tag: str = "0.5b") -> Path:
    """The family's checkpoint folder ``<model_type>-<tag>``, built and saved the first time;
    ``shape``: config values over SHAPE and the family's EXTRA (another size)."""
    out = FOLDER / f"{model_type}-{tag}"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tokenrelay.engine.models.store import resolve_model

    say(f"building {out.name} (random weights) ...")
    tok = AutoTokenizer.from_pretrained(str(resolve_model("default")))
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
           "pad_token_id": tok.pad_token_id or tok.eos_token_id}  # fmt: skip
    values = {**SHAPE, **EXTRA[model_type], **(shape or {})}
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tok), **values, **ids)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def run(model: Path, extra: list[str]) -> tuple[str, float | None]:
    """Run bench.engine_throughput on ``model``; its output and ours/transformers."""
    cmd = [sys.executable, "-m", "bench.engine_throughput", "--model", str(model),
           "--skip-latency", "--skip-hf-batch", *extra]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    found = re.search(r"ours / faster transformers \([^)]*\): \*\*([0-9.]+)x\*\*", text)
    return text, float(found.group(1)) if found else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.families", description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    ap.add_argument("--families", default=None, help="comma-separated model_types")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-input", type=int, default=200)
    args = ap.parse_args(argv)
    names = args.families.split(",") if args.families else supported()
    extra = ["--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len),
             "--max-input", str(args.max_input)]  # fmt: skip
    say(f"machine: {machine()}; load average {load_average()}")
    rows = []
    for name in names:
        folder = build(name)
        say(f"== {name}: bench.engine_throughput {' '.join(extra)}")
        text, ratio = run(folder, extra)
        tables = [line for line in text.splitlines() if line.startswith("|")]
        say("\n".join(tables) if tables else text[-3000:])
        rows.append((name, ratio, load_average()))
    say("\n| model_type | ours / transformers generate | target | load after |")
    say("|---|---:|---|---|")
    for name, ratio, load in rows:
        got = "failed" if ratio is None else f"{ratio:.2f}x"
        say(f"| {name} | {got} | >= 2x | {load} |")
    say(f"\ncommand: python -m bench.families {' '.join(argv or sys.argv[1:])}")
    return 0 if all(r is not None for _, r, _ in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
