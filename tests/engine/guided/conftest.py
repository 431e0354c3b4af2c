"""Guided-decoding fixtures: the default model's tokenizer and one grammar compiler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer(model_path: Path) -> Any:
    from tokenrelay.engine.text.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def compiler(tokenizer: Any) -> Any:
    """A compiler for the default model: vocabulary 49,152, EOS ``<|im_end|>`` (2)."""
    from tokenrelay.engine.guided.compiler import GrammarCompiler

    return GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id])
