"""How each model family writes a tool call: its markers, its JSON, its grammar.

Sans I/O and torch-free. A model's format comes from its chat template
(:func:`detect_format`); the worker's parser (core/wire/tool_stream.py) reads the calls
back in it, and a ``required`` or named ``tool_choice`` constrains the output to it
(:func:`call_grammar`). The formats:

* ``hermes`` (Qwen, SmolLM, Hermes, and every template that does not show tools itself):
  ``<tool_call>`` newline ``{"name": ..., "arguments": {...}}`` newline ``</tool_call>``,
  one block per call, after the answer's content if any;
* ``llama3`` (Llama 3.1-3.3): the answer *is* the call, ``{"name": ...,
  "parameters": {...}}``, optionally after ``<|python_tag|>``; several separated by ``;``;
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects,
  or (newer tokenizers) ``[TOOL_CALLS]name[ARGS]{...}`` per call;
* ``granite`` (Granite 3.x): ``<|tool_call|>`` then a JSON array of ``{"name",
  "arguments"}`` objects.

Either key, ``arguments`` or ``parameters``, is read in every format.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenrelay.core.wire.response_format import GRAMMAR_OPTIONS
from tokenrelay.core.wire.vocabulary import ToolFormat

if TYPE_CHECKING:
    from tokenrelay.core.wire.tools import Tool, ToolChoice

__all__ = ["SYNTAX", "Syntax", "ToolFormat", "call_grammar", "detect_format"]


@dataclass(frozen=True)
class Syntax:
    """What a format's parser looks for.

    ``openers``: the markers that start a region of calls; ``closer``: the marker that
    ends each call (Hermes) or None; ``array``: the region holds a JSON array of call
    objects (a single object is read too); ``leading_object``: a ``{`` that starts the
    answer (after whitespace) opens a call; ``separators``: what may stand between two
    call objects besides whitespace; ``named_args``: ``name[ARGS]{...}`` is read too.
    """

    openers: tuple[str, ...]
    closer: str | None = None
    array: bool = False
    leading_object: bool = False
    separators: str = ""
    named_args: str | None = None
    args_key: str = "arguments"  # the key the grammar writes


SYNTAX: dict[ToolFormat, Syntax] = {
    ToolFormat.HERMES: Syntax(openers=("<tool_call>",), closer="</tool_call>"),
    ToolFormat.LLAMA3: Syntax(
        openers=("<|python_tag|>",), leading_object=True, separators=";", args_key="parameters"
    ),
    ToolFormat.MISTRAL: Syntax(openers=("[TOOL_CALLS]",), array=True, named_args="[ARGS]"),
    ToolFormat.GRANITE: Syntax(openers=("<|tool_call|>",), array=True),
}


def detect_format(template: str | None) -> ToolFormat:
    """The format a chat template's model writes calls in (a look at its source).

    A template that does not show tools gets the Hermes instructions of
    :func:`core.wire.tools.system_prompt`, so Hermes is the answer for it too.
    """
    src = template or ""
    if "tools" not in src or "<tool_call>" in src:
        return ToolFormat.HERMES
    if "[TOOL_CALLS]" in src:
        return ToolFormat.MISTRAL
    if "<|tool_call|>" in src:
        return ToolFormat.GRANITE
    if "<|start_header_id|>" in src and ("<|python_tag|>" in src or '"parameters"' in src):
        return ToolFormat.LLAMA3
    return ToolFormat.HERMES


def call_grammar(
    tools: Sequence[Tool],
    choice: ToolChoice,
    parallel: bool,
    fmt: ToolFormat = ToolFormat.HERMES,
) -> str:
    """The Lark grammar (llguidance's dialect) of the calls ``choice`` requires, written
    the way ``fmt`` writes them: one call (``parallel`` off, or a named function) or one
    or more, each object ``{"name": <const>, <args key>: <its schema>}`` as compact JSON
    (GRAMMAR_OPTIONS)."""
    chosen = [t for t in tools if choice.mode != "function" or t.name == choice.name]
    if not choice.constrained or not chosen:
        raise ValueError(f"tool_choice {choice.mode!r} does not constrain the output")
    syntax = SYNTAX[fmt]
    key = syntax.args_key
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, key: json.loads(t.parameters)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    schema = {"x-guidance": GRAMMAR_OPTIONS, "anyOf": options}
    many = parallel and choice.mode == "required"
    q = json.dumps
    if fmt == ToolFormat.HERMES:
        assert syntax.closer is not None
        start = f"start: call{'+' if many else ''}"
        call = f"call: {q(syntax.openers[0] + chr(10))} obj {q(chr(10) + syntax.closer)}"
    elif fmt == ToolFormat.LLAMA3:
        start = "start: call"
        call = f"call: obj ({q(';')} obj)*" if many else "call: obj"
    else:  # an array after the marker
        start = "start: call"
        more = f" ({q(',')} obj)*" if many else ""
        call = f"call: {q(syntax.openers[0] + '[')} obj{more} {q(']')}"
    obj = "obj: %json " + json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    return "\n".join([start, call, obj])
