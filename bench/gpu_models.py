"""Random-weight checkpoints and transformers' greedy reference, for bench.gpu_check.

A checkpoint is built with transformers' own model class (seeded random init,
norm weights perturbed around 1 so a loader that ignores them is caught), saved
as safetensors in the run's dtype with a synthetic word-level tokenizer that
covers every id (``"t0"`` .. ``"t<vocab-1>"``). The transformers model that was
saved stays in memory as the reference. Needs no download. Imports of torch,
transformers and tokenizers happen inside the functions, so a missing one fails
the phase that needs it, not the module.
"""

from __future__ import annotations

import copy
import inspect
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

EOS_ID, PAD_ID = 1, 0  # "t1" and "t0" in the synthetic tokenizer
LOGIT_STD = 0.64  # init std of the logits: normed hidden @ embed^T ~ init_std * sqrt(hidden)
NORM_JITTER = 0.1  # norm weights ~ N(1, 0.1): a loader that drops them changes the tokens


@dataclass(frozen=True)
class ModelShape:
    """One architecture's shapes (the model's config.json, in short)."""

    key: str  # short name in the JSON: "smollm2", "qwen3"
    label: str  # what the table prints
    arch: str  # "llama" or "qwen3"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float
    rms_eps: float
    max_pos: int


# The published shapes of SmolLM2-135M and Qwen3-0.6B (both tie their embeddings).
SMOLLM2 = ModelShape(
    "smollm2", "SmolLM2-135M", "llama", 576, 30, 9, 3, 64, 1536, 49152, 100_000.0, 1e-5, 8192
)
QWEN3 = ModelShape(
    "qwen3", "Qwen3-0.6B", "qwen3", 1024, 28, 16, 8, 128, 3072, 151936, 1_000_000.0, 1e-6, 40960
)
# ``--tiny``: the same two architectures at sizes that run anywhere in seconds.
TINY_SMOLLM2 = ModelShape(
    "smollm2", "tiny llama", "llama", 96, 2, 6, 2, 16, 192, 512, 100_000.0, 1e-5, 4096
)
TINY_QWEN3 = ModelShape(
    "qwen3", "tiny qwen3", "qwen3", 64, 2, 4, 2, 16, 128, 512, 1_000_000.0, 1e-6, 4096
)


def shapes(tiny: bool) -> tuple[ModelShape, ModelShape]:
    """The correctness-only model and the model every phase uses, in that order."""
    return (TINY_SMOLLM2, TINY_QWEN3) if tiny else (SMOLLM2, QWEN3)


def _hf_config(shape: ModelShape) -> Any:
    """The transformers config object for ``shape`` (rope keyword of this version)."""
    from transformers import LlamaConfig, Qwen3Config

    cls = Qwen3Config if shape.arch == "qwen3" else LlamaConfig
    kwargs: dict[str, Any] = dict(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate,
        vocab_size=shape.vocab,
        max_position_embeddings=shape.max_pos,
        rms_norm_eps=shape.rms_eps,
        tie_word_embeddings=True,
        initializer_range=LOGIT_STD / shape.hidden**0.5,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        bos_token_id=None,
    )
    if shape.arch == "qwen3":
        kwargs["use_sliding_window"] = False
    if "rope_parameters" in inspect.signature(cls.__init__).parameters:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": shape.rope_theta}
    else:
        kwargs["rope_theta"] = shape.rope_theta
    return cls(**kwargs)


def build_checkpoint(folder: Path, shape: ModelShape, seed: int, device: Any, dtype: Any) -> Any:
    """Save a random ``shape`` checkpoint + tokenizer in ``folder``; return the HF model.

    The returned model is on ``device`` in ``dtype`` (eval mode) and holds exactly the
    saved weights: it is the reference our engine is compared with.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3ForCausalLM

    config = _hf_config(shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = (Qwen3ForCausalLM if shape.arch == "qwen3" else LlamaForCausalLM)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, NORM_JITTER)
    model = model.to(dtype).eval()
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = EOS_ID, PAD_ID, None
    model.save_pretrained(str(folder))

    vocab = {f"t{i}": i for i in range(shape.vocab)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=f"t{EOS_ID}", pad_token=f"t{PAD_ID}", unk_token="t0"
    )
    fast.save_pretrained(str(folder))
    return model


def weight_bytes(model: Any) -> int:
    """Bytes of the weights a decode step reads: every parameter once (tied counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def check_loadable(folder: Path, shape: ModelShape) -> None:
    """Our config parser reads the folder with the intended shapes and flags."""
    from tokenrelay.engine.models.config import ModelConfig

    cfg = ModelConfig.from_pretrained(folder)
    got = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    want = (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim)
    problems = []
    if got != want:
        problems.append(f"shapes {got} != {want}")
    if cfg.rope.theta != shape.rope_theta or cfg.rope.rope_type != "default":
        problems.append(f"rope {cfg.rope.rope_type} theta {cfg.rope.theta}")
    if not cfg.tie_word_embeddings or cfg.qk_norm != (shape.arch == "qwen3"):
        problems.append(f"flags: tied {cfg.tie_word_embeddings}, qk_norm {cfg.qk_norm}")
    if problems:
        raise RuntimeError(f"our ModelConfig reads {folder.name} wrong: {'; '.join(problems)}")


# ------------------------------------------------------------------ greedy reference
def greedy_prompts(shape: ModelShape, lens: tuple[int, ...], seed: int) -> list[list[int]]:
    """Random token-id prompts of the given lengths (seeded)."""
    rng = random.Random(seed)
    return [[rng.randrange(shape.vocab) for _ in range(n)] for n in lens]


def hf_greedy(hf: Any, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], Any]:
    """transformers ``generate``, greedy, EOS ignored, one prompt at a time (no padding).

    Returns the tokens and, per prompt, the fp32 logits of every step ``[new_tokens, V]``
    on the CPU (what the divergence analysis reads).
    """
    import torch

    config = copy.deepcopy(hf.generation_config)
    config.do_sample = False
    config.max_new_tokens = new_tokens
    config.min_new_tokens = None
    config.eos_token_id = []  # generate through EOS, like our ignore_eos
    config.pad_token_id = PAD_ID
    config.output_logits = True  # the raw logits of every step
    config.return_dict_in_generate = True
    tokens, logits = [], []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=hf.device)
            out = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
            tokens.append(out.sequences[0, len(ids) :].tolist())
            logits.append(torch.stack([row[0] for row in out.logits]).float().cpu())
    return tokens, logits


def ulp(x: float, eps: float) -> float:
    """The spacing of floats near ``x`` for a dtype whose machine epsilon is ``eps``."""
    return eps * 2.0 ** math.floor(math.log2(max(abs(x), 1e-30)))


def compare_greedy(
    ours: list[list[int]], ref: list[list[int]], ref_logits: list[Any], eps: float, tie_ulps: float
) -> list[dict[str, Any]]:
    """Per prompt: agreement, first divergence, and whether it is a logit tie.

    At the first divergence the context is the same for both (the tokens before it
    agree), so transformers' logits of that step say how close the call was:
    ``gap`` is its top-1 logit minus its logit of our token, ``top2_gap`` its own
    top-1 minus top-2. A divergence is a ``tie`` when ``gap`` is within ``tie_ulps``
    units in the last place (of the run's dtype) of the top-1 logit.
    """
    rows = []
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        row: dict[str, Any] = {
            "prompt": i,
            "tokens": len(b),
            "agree": sum(x == y for x, y in zip(a, b, strict=False)) / max(len(b), 1),
            "first_divergence": first,
            "verdict": "equal",
        }
        if first is not None:
            row["verdict"] = "MISMATCH"
            if first < min(len(a), len(b)):
                step = ref_logits[i][first]
                top = step.topk(2)
                top1 = float(top.values[0])
                mine = float(step[a[first]])
                row.update(
                    ours_token=a[first],
                    ref_token=b[first],
                    gap=top1 - mine,
                    gap_ulps=(top1 - mine) / ulp(top1, eps),
                    top2_gap=top1 - float(top.values[1]),
                    ours_rank=int((step > mine).sum()),  # 0 = transformers' own pick
                )
                if row["gap"] <= tie_ulps * ulp(top1, eps):
                    row["verdict"] = "tie"
        rows.append(row)
    return rows


# ------------------------------------------------------------------ throughput
@dataclass
class Result:
    """One system's throughput run."""

    name: str
    seconds: float
    output_tokens: int
    prompt_tokens: int
    requests_done: int
    requests: int
    partial: bool = False  # stopped by its time guard
    warmup_s: float = 0.0
    note: str = ""

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tok_s": self.tok_s}


def make_workload(
    n: int, lo: int, hi: int, vocab: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench: random ids, input and output lengths uniform in [lo, hi]."""
    rng = random.Random(seed)
    prompts, out_lens = [], []
    for _ in range(n):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(lo, hi))])
        out_lens.append(rng.randint(lo, hi))
    return prompts, out_lens
