"""Tool calls: the request's ``tools`` and ``tool_choice``, and calls parsed from the text.

Sans I/O and torch-free: the gateway validates with it, the engine builds the prompt
and the grammar from it, the worker reads the calls with it as they are generated.

How a model writes a call depends on its family (core/wire/tool_formats.py: Hermes'
``<tool_call>`` blocks, Llama 3's JSON, Mistral's ``[TOOL_CALLS]``, Granite's
``<|tool_call|>``); core/wire/tool_stream.py reads them while the text streams, as
:class:`CallDelta` s that token events carry (:func:`encode_deltas`). A finished
completion with at least one well-formed call of an offered tool ends with
``finish_reason`` ``tool_calls`` and its done event lists the calls
(:func:`encode_calls`). Text that is no call (not JSON, a tool that was not offered) is
content, as a model that wrote prose about tags.

``tool_choice`` (OpenAI's values):

* ``"none"``: the tools are not shown to the model and nothing is parsed;
* ``"auto"`` (the default with tools): the tools are shown (the chat template's own
  way where it takes ``tools``, else :func:`system_prompt`) and calls are parsed;
* ``"required"``: the output is constrained (:func:`call_grammar`) to one call of an
  offered tool, or several when ``parallel_tool_calls`` (the default);
* ``{"type": "function", "function": {"name": ...}}``: constrained to one call of it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenrelay.core.wire.errors import ToolError
from tokenrelay.core.wire.response_format import MAX_NAME, check_schema
from tokenrelay.core.wire.tool_formats import call_grammar
from tokenrelay.core.wire.tool_stream import (
    MAX_CALL_CHARS,
    MAX_CALLS,
    CallDelta,
    CallStream,
    ToolCall,
    call_id,
)
from tokenrelay.core.wire.vocabulary import ErrorCode, ToolFormat

__all__ = [
    "CLOSE",
    "MAX_CALLS",
    "MAX_CALL_CHARS",
    "MAX_TOOLS",
    "OPEN",
    "CallDelta",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "ToolError",
    "call_grammar",
    "call_id",
    "content_before_calls",
    "decode_calls",
    "decode_deltas",
    "delta_to_openai",
    "encode_calls",
    "encode_deltas",
    "parse_tool_calls",
    "parse_tool_choice",
    "parse_tools",
    "render_call",
    "system_prompt",
]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
MAX_DESCRIPTION = 4096
_NAME_RE = re.compile(r"[A-Za-z0-9_-]+")
_EMPTY_PARAMETERS = '{"type":"object","properties":{}}'


@dataclass(frozen=True)
class Tool:
    """One offered function; ``parameters`` is its checked JSON schema as compact text."""

    name: str
    description: str | None = None
    parameters: str = _EMPTY_PARAMETERS

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's ``{"type": "function", "function": {...}}`` (what templates take)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """``mode`` is ``none``, ``auto``, ``required`` or ``function`` (then ``name``)."""

    mode: str
    name: str | None = None

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "function")

    def to_value(self) -> str | dict[str, Any]:
        if self.mode != "function":
            return self.mode
        return {"type": "function", "function": {"name": self.name}}


def _kind(value: Any) -> str:
    return type(value).__name__ if value is not None else "null"


def _name(value: Any, field: str) -> str:
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= MAX_NAME
        or not _NAME_RE.fullmatch(value)
    ):
        raise ToolError(f"must be 1 to {MAX_NAME} of a-z, A-Z, 0-9, '_' and '-'", field)
    return value


def parse_tools(value: Any, field: str = "tools") -> tuple[Tool, ...]:
    """The request's ``tools`` (OpenAI's shape), checked; ``()`` for none."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ToolError(f"must be an array, got {_kind(value)}", field)
    if len(value) > MAX_TOOLS:
        raise ToolError(f"at most {MAX_TOOLS} tools", field, ErrorCode.TOO_LARGE)
    tools: dict[str, Tool] = {}
    for i, raw in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(raw, dict) or raw.get("type") != "function":
            raise ToolError("must be an object with type 'function'", where)
        if set(raw) - {"type", "function"}:
            raise ToolError(
                "unknown field", f"{where}.{sorted(set(raw) - {'type', 'function'})[0]}"
            )
        fn = raw.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"must be an object, got {_kind(fn)}", f"{where}.function")
        extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if extra:
            raise ToolError("unknown field", f"{where}.function.{extra[0]}")
        name = _name(fn.get("name"), f"{where}.function.name")
        if name in tools:
            raise ToolError(f"two tools are named {name!r}", f"{where}.function.name")
        desc = fn.get("description")
        if desc is not None and (not isinstance(desc, str) or len(desc) > MAX_DESCRIPTION):
            raise ToolError(f"must be a string of at most {MAX_DESCRIPTION} characters",
                            f"{where}.function.description")  # fmt: skip
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ToolError("must be a boolean", f"{where}.function.strict")
        params = fn.get("parameters")
        if params is None:
            text = _EMPTY_PARAMETERS
        elif isinstance(params, dict):
            text = check_schema(params, f"{where}.function.parameters")
        else:
            raise ToolError(
                f"must be an object, got {_kind(params)}", f"{where}.function.parameters"
            )
        tools[name] = Tool(name, desc, text)
    return tuple(tools.values())


def parse_tool_choice(value: Any, tools: Sequence[Tool], field: str = "tool_choice") -> ToolChoice:
    """The request's ``tool_choice`` against its ``tools`` (default: ``auto`` with tools)."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise ToolError(f"{value!r} needs at least one tool in 'tools'", field)
        return ToolChoice(str(value))
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = _name(fn.get("name") if isinstance(fn, dict) else None, f"{field}.function.name")
        if name not in {t.name for t in tools}:
            raise ToolError(f"no tool named {name!r} in 'tools'", f"{field}.function.name")
        return ToolChoice("function", name)
    message = "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}"
    raise ToolError(message, field)


def render_call(name: str, arguments: Any) -> str:
    """One call as the model writes it (``arguments``: an object or its JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def system_prompt(tools: Sequence[Tool]) -> str:
    """How the tools are shown to a model whose chat template does not take them."""
    listed = "\n".join(json.dumps(t.to_dict(), ensure_ascii=False) for t in tools)
    example = render_call("<function-name>", {"<argument>": "<value>"})
    return (
        "You can call functions to help with the user's request. The functions are "
        f"listed inside <tools></tools> as JSON signatures:\n<tools>\n{listed}\n</tools>\n"
        "To call one, answer with a JSON object holding its name and arguments inside "
        f"{OPEN}{CLOSE} tags, like this:\n{example}"
    )


def parse_tool_calls(
    text: str, tools: Sequence[Tool], stream_id: str, fmt: ToolFormat = ToolFormat.HERMES
) -> tuple[str, tuple[ToolCall, ...]]:
    """``(content, calls)`` of a finished completion's text, read as the worker reads it
    while it streams (core/wire/tool_stream.py)."""
    reader = CallStream(fmt, tools, stream_id)
    first, last = reader.feed(text), reader.finish()
    return first.content + last.content, tuple(reader.calls)


def encode_calls(calls: Sequence[ToolCall]) -> str:
    """The ``done`` event's ``tc`` field: compact JSON ``[[id, name, arguments], ...]``."""
    return json.dumps([[c.id, c.name, c.arguments] for c in calls], ensure_ascii=False)


def encode_deltas(deltas: Sequence[CallDelta]) -> str:
    """A token event's ``d`` field: compact JSON ``[[index, name or null, arguments], ...]``."""
    return json.dumps([[d.index, d.name, d.arguments] for d in deltas], ensure_ascii=False)


def decode_deltas(raw: str | None) -> tuple[CallDelta, ...]:
    """The call deltas of a ``d`` field (none when absent or unreadable)."""
    if not raw:
        return ()
    try:
        rows = json.loads(raw)
        return tuple(CallDelta(int(i), None if n is None else str(n), str(a)) for i, n, a in rows)
    except (ValueError, TypeError):
        return ()


def delta_to_openai(delta: CallDelta, stream_id: str) -> dict[str, Any]:
    """One entry of OpenAI's ``delta.tool_calls``: the first of a call carries its id,
    type and name, the others its index and an ``arguments`` fragment."""
    fn: dict[str, Any] = {"arguments": delta.arguments}
    out: dict[str, Any] = {"index": delta.index}
    if delta.name is not None:
        out["id"] = call_id(stream_id, delta.index)
        out["type"] = "function"
        fn = {"name": delta.name, **fn}
    out["function"] = fn
    return out


def decode_calls(raw: str | None) -> tuple[ToolCall, ...]:
    """The calls of a ``tc`` field (none when absent or unreadable)."""
    if not raw:
        return ()
    try:
        rows = json.loads(raw)
        return tuple(ToolCall(str(i), str(n), str(a)) for i, n, a in rows)
    except (ValueError, TypeError):
        return ()


def content_before_calls(text: str) -> str:
    """The content of a completion that made calls: its text before the first call."""
    return text.split(OPEN, 1)[0]
