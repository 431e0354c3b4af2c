"""A family whose call marker is a special token (Mistral's ``[TOOL_CALLS]``, Llama's
``<|python_tag|>``, Granite's ``<|tool_call|>``): the detokenizer keeps that token's
text for a request offering tools, so the worker's call reader sees the marker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenrelay.core.wire.tool_formats import ToolFormat
from tokenrelay.core.wire.tool_stream import CallStream
from tokenrelay.core.wire.tools import Tool
from tokenrelay.engine.text.chat import marker_tokens
from tokenrelay.engine.text.detokenizer import IncrementalDetokenizer


def tokenizer_with(model_path: Path, marker: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    tok.add_special_tokens({"additional_special_tokens": [marker]})
    return tok


def text_of(tok: Any, ids: list[int], keep: dict[int, str] | None) -> str:
    detok = IncrementalDetokenizer(tok, (), keep)
    return "".join(detok.add(i) for i in ids) + detok.flush()


def test_a_special_marker_is_kept_and_the_call_read(model_path: Path) -> None:
    tok = tokenizer_with(model_path, "[TOOL_CALLS]")
    kept = marker_tokens(tok, ToolFormat.MISTRAL)
    marker_id = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert kept == {marker_id: "[TOOL_CALLS]"}
    body = '[{"name": "add", "arguments": {"a": 1}}]'
    ids = tok("Sure.", add_special_tokens=False)["input_ids"] + [marker_id]
    ids += tok(body, add_special_tokens=False)["input_ids"]
    assert text_of(tok, ids, None) == "Sure." + body  # skipped, as every special token
    text = text_of(tok, ids, kept)
    assert text == "Sure.[TOOL_CALLS]" + body
    reader = CallStream(ToolFormat.MISTRAL, (Tool("add"),), "s")
    assert reader.feed(text).content == "Sure."
    assert [(c.name, c.arguments) for c in reader.calls] == [("add", '{"a": 1}')]


def test_markers_that_are_plain_text_are_not_kept(model_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))  # no such special tokens
    for fmt in ToolFormat:
        assert marker_tokens(tok, fmt) == {}
