"""The whole engine on the Triton backend (Triton's CPU interpreter) against the default one.

The default model in fp32, a few short prompts, greedy: the same tokens as the
session's engine (the ``cpu`` backend), through prefill with a cached prefix and
decode steps. Slow under the interpreter, so few prompts and few tokens.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import torch

from tokenrelay.engine import LLM, SamplingParams

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton"),
]

STORY = "Here is a short story about a dragon who learned to fly over the snowy mountains. "
PROMPTS = [STORY + "Once", STORY + "In the end, the dragon"]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_triton_backend_gives_the_default_backends_greedy_tokens(llm_engine: Any) -> None:
    llm = LLM(model="default", device="cpu", weights="fp32", attention_backend="triton",
              block_size=16, num_blocks=64, max_num_batched_tokens=64)  # fmt: skip
    runner = llm.engine.runner
    assert runner.attention_backend == "triton" and runner.graph_buckets == ()
    assert llm_engine.runner.attention_backend == "cpu"
    # one at a time: the second prompt's first block comes cached from the first
    ours = [out.token_ids for p in PROMPTS for out in llm.generate([p], GREEDY)]
    assert llm.engine.block_manager.stats()["prefix_cache_hit_tokens"] >= 16
    ref = [out.token_ids for out in LLM.from_engine(llm_engine).generate(PROMPTS, GREEDY)]
    assert ours == ref
