"""Loading a model folder's tokenizer without paying for ``AutoTokenizer``.

``AutoTokenizer.from_pretrained`` first resolves the model's configuration
class, which imports a large part of transformers: several times as long to a
loaded tokenizer in a fresh process as the class directly (``python -m
bench.engine_profile start``; docs/benchmarks.md, "Engine profile"). A folder whose
``tokenizer_config.json`` names the generic fast tokenizer (what transformers
writes for a ``tokenizer.json``-backed tokenizer, as for the cached default
model) is loaded with that class directly: the same object ``AutoTokenizer``
returns. Any other folder (a model-specific tokenizer class, a slow
SentencePiece tokenizer) goes through ``AutoTokenizer`` as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# tokenizer_class values that mean "the generic tokenizers-backed class, nothing model-specific"
GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def generic_tokenizer_class(folder: Path) -> str | None:
    """The generic class named by ``folder``'s tokenizer config, or None if it names another."""
    if not (folder / "tokenizer.json").is_file():
        return None
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if name in GENERIC_CLASSES else None


def load_tokenizer(folder: Path) -> Any:
    """The tokenizer of a local model folder (what ``AutoTokenizer`` would load)."""
    import transformers

    name = generic_tokenizer_class(folder)
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))
    return cls.from_pretrained(str(folder))
