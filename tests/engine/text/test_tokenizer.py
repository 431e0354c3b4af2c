"""engine/text/tokenizer.py: the direct load gives what AutoTokenizer gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tokenrelay.engine.text.tokenizer import generic_tokenizer_class, load_tokenizer

TEXTS = [
    "Hello, world!",
    "def f(x):\n    return x ** 2  # ünïcödé, 日本語, emoji 🎉",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


def test_default_model_loads_like_auto_tokenizer(model_path: Path) -> None:
    from transformers import AutoTokenizer

    assert generic_tokenizer_class(model_path) is not None
    ours, auto = load_tokenizer(model_path), AutoTokenizer.from_pretrained(str(model_path))
    assert type(ours) is type(auto)
    for text in TEXTS:
        assert ours(text)["input_ids"] == auto(text)["input_ids"], text
        ids = auto(text)["input_ids"]
        assert ours.decode(ids) == auto.decode(ids)
    chat = [{"role": "user", "content": "Why is the sky blue?"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == auto.apply_chat_template(
        chat, add_generation_prompt=True
    )
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids"):
        assert getattr(ours, attr) == getattr(auto, attr), attr


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"tokenizer_class": "TokenizersBackend"}, "TokenizersBackend"),
        ({"tokenizer_class": "PreTrainedTokenizerFast"}, "PreTrainedTokenizerFast"),
        ({"tokenizer_class": "LlamaTokenizerFast"}, None),  # model-specific: AutoTokenizer
        ({}, None),
        ("not a dict", None),
    ],
)
def test_only_the_generic_class_takes_the_direct_path(
    tmp_path: Path, config: object, expected: str | None
) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert generic_tokenizer_class(tmp_path) == expected


def test_without_tokenizer_json_or_config_goes_through_auto_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "TokenizersBackend"}')
    assert generic_tokenizer_class(tmp_path) is None  # no tokenizer.json
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert generic_tokenizer_class(tmp_path) is None


def test_a_model_specific_class_still_loads(tmp_path: Path, model_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (model_path / name).exists():
            shutil.copy(model_path / name, tmp_path / name)
    shutil.copy(model_path / "config.json", tmp_path / "config.json")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2TokenizerFast"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert (
        tok("Hello, world!")["input_ids"]
        == load_tokenizer(model_path)("Hello, world!")["input_ids"]
    )
