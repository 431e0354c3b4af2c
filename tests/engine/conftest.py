"""Engine test fixtures: one real engine and one transformers reference per session.

Several engineers add fixtures here: append, don't rewrite.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GREEDY_TOKENS = 64

# 16 varied prompts: raw text and chat turns, short to a few hundred tokens.
RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8, 13,",
    "Translate to French: The weather is lovely today.",
    "import numpy as np\n\n# compute the mean of each row\n",
    "The three laws of thermodynamics are " * 6,
    "Q: What is the boiling point of water?\nA:",
]
CHAT_PROMPTS = [
    "Hi!",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a five year old.",
    "List three uses of a paperclip.",
    "What is 17 times 23? Show your steps.",
    "Summarize this: " + "The quick brown fox jumps over the lazy dog. " * 20,
    "Give me a short recipe for pancakes.",
    "Why is the sky blue? " * 12,
]


@pytest.fixture(scope="session")
def model_path() -> Path:
    from tokenrelay.engine.models.store import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def llm_engine() -> Iterator[Any]:
    """The session's shared engine (default pool, prefix caching on), dense fp32 weights.

    fp32, not the default native blocks: the greedy tests compare it token for token
    with transformers, which runs the same dequantized checkpoint.

    Tests must leave it with nothing unfinished.
    """
    from tokenrelay.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model="default", device="cpu", weights="fp32"))
    yield engine
    assert not engine.has_unfinished()


@pytest.fixture(scope="session")
def greedy_prompts(llm_engine: Any) -> list[list[int]]:
    """The 16 greedy test prompts as token ids (8 raw, 8 chat-templated)."""
    tok = llm_engine.tokenizer
    raw = [list(tok(p)["input_ids"]) for p in RAW_PROMPTS]
    chat = [llm_engine.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT_PROMPTS]
    return raw + chat


@pytest.fixture(scope="session")
def hf_model(model_path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_greedy(
    request: pytest.FixtureRequest, model_path: Path, greedy_prompts: list[list[int]]
) -> list[list[int]]:
    """transformers' own greedy ``generate``: GREEDY_TOKENS ids per prompt, EOS not stopping.

    One ``generate`` call over all prompts, left-padded with an attention mask (several
    times faster than one call per prompt, and the same ids for these prompts).
    ``eos_token_id=[]`` keeps generating through
    EOS (like our ``ignore_eos``) without suppressing it the way
    ``min_new_tokens`` would. The result is kept in pytest's cache, keyed by the
    weights file, the prompts and the torch and transformers versions.
    """
    import torch
    import transformers

    weights = sorted(model_path.glob("*.safetensors"))
    key_src = json.dumps(
        [
            [str(w.resolve()) for w in weights],
            [w.stat().st_size for w in weights],
            [w.stat().st_mtime_ns for w in weights],
            greedy_prompts,
            GREEDY_TOKENS,
            "one left-padded batch",
            torch.__version__,
            transformers.__version__,
        ]
    )
    key = "tokenrelay/hf_greedy/" + hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        cached = cache.get(key, None)
        if isinstance(cached, list) and len(cached) == len(greedy_prompts):
            return cached
    out = hf_generate_greedy(request.getfixturevalue("hf_model"), greedy_prompts, GREEDY_TOKENS)
    if cache is not None:
        cache.set(key, out)
    return out


def hf_generate_greedy(model: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate`` of ``tokens`` ids per prompt, EOS not stopping:
    one call over all prompts, left-padded with an attention mask."""
    import torch

    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    config.max_new_tokens = tokens
    config.eos_token_id = []
    config.pad_token_id = model.generation_config.pad_token_id or 0
    width = max(map(len, prompts))
    pads = [width - len(ids) for ids in prompts]
    batch = torch.tensor(
        [[config.pad_token_id] * n + ids for n, ids in zip(pads, prompts, strict=True)]
    )
    mask = torch.tensor([[0] * n + [1] * (width - n) for n in pads])
    with torch.inference_mode():
        gen = model.generate(batch, attention_mask=mask, generation_config=config)
    return [row[width:].tolist() for row in gen]


# --- torch side (model runner, model, detokenizer): E1's fixtures; keep when editing ---


@pytest.fixture(scope="session")
def model_runner(model_path: Path) -> Any:
    """A CPU ModelRunner on the default model with a small pool (256 blocks of 16)."""
    from tokenrelay.engine.runner.model_runner import ModelRunner

    return ModelRunner(model_path, device="cpu", block_size=16, num_blocks=256)


@pytest.fixture(scope="session")
def default_tokenizer(model_path: Path) -> Any:
    """The default model's tokenizer (transformers)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))
