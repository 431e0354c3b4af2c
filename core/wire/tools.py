"""Tool calls: the request's ``tools`` and ``tool_choice``, and calls parsed from the text.

Sans I/O and torch-free: the gateway validates with it, the engine builds the prompt
and the grammar from it, the worker parses the finished text with it.

The format is Hermes-style, the one Qwen's chat templates use: a call is
``<tool_call>`` + newline + ``{"name": ..., "arguments": {...}}`` + newline +
``</tool_call>`` in the completion text. What comes before the first ``<tool_call>``
is the answer's content; a finished completion with at least one well-formed call of
an offered tool ends with ``finish_reason`` ``tool_calls``. A block that does not
parse, or names a tool that was not offered, is no call: the whole text is then
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

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenrelay.core.wire.errors import ToolError
from tokenrelay.core.wire.response_format import GRAMMAR_OPTIONS, MAX_NAME, check_schema
from tokenrelay.core.wire.vocabulary import ErrorCode

__all__ = [
    "CLOSE",
    "MAX_TOOLS",
    "OPEN",
    "CallTextFilter",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "ToolError",
    "call_grammar",
    "call_id",
    "content_before_calls",
    "decode_calls",
    "encode_calls",
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
MAX_CALL_CHARS = 256 * 1024  # a block longer than this is no call (never parsed)
MAX_CALLS = 128  # calls parsed from one completion, at most
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


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: ``arguments`` is JSON text (OpenAI sends it as a string)."""

    id: str
    name: str
    arguments: str

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {} if index is None else {"index": index}
        fn = {"name": self.name, "arguments": self.arguments}
        return {**out, "id": self.id, "type": "function", "function": fn}


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


def call_grammar(tools: Sequence[Tool], choice: ToolChoice, parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect) of the calls ``choice`` requires.

    One call (``parallel`` off, or a named function) or one or more, each
    ``OPEN\\n{"name": <const>, "arguments": <its schema>}\\nCLOSE``, compact JSON as
    ``response_format`` gives it (GRAMMAR_OPTIONS).
    """
    chosen = [t for t in tools if choice.mode != "function" or t.name == choice.name]
    if not choice.constrained or not chosen:
        raise ValueError(f"tool_choice {choice.mode!r} does not constrain the output")
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": json.loads(t.parameters)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    schema = {"x-guidance": GRAMMAR_OPTIONS, "anyOf": options}
    many = parallel and choice.mode == "required"
    return "\n".join(
        [
            f"start: call{'+' if many else ''}",
            f"call: {json.dumps(OPEN + chr(10))} obj {json.dumps(chr(10) + CLOSE)}",
            "obj: %json " + json.dumps(schema, separators=(",", ":"), ensure_ascii=False),
        ]
    )


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


def call_id(stream_id: str, index: int) -> str:
    """A call's id: stable for the stream, so a resumed or re-read answer shows the same."""
    digest = hashlib.sha256(f"{stream_id}:{index}".encode()).hexdigest()
    return "call_" + digest[:24]


def call_blocks(text: str) -> list[str]:
    """What stands between each ``<tool_call>`` and the first ``</tool_call>`` after it,
    stripped: one linear scan (``str.find``), whatever the text holds; a block over
    :data:`MAX_CALL_CHARS` is skipped unread."""
    blocks: list[str] = []
    at = text.find(OPEN)
    while at >= 0:
        start = at + len(OPEN)
        end = text.find(CLOSE, start)
        if end < 0:
            break
        if end - start <= MAX_CALL_CHARS:
            blocks.append(text[start:end].strip())
        at = text.find(OPEN, end + len(CLOSE))
    return blocks


def parse_tool_calls(
    text: str, tools: Sequence[Tool], stream_id: str
) -> tuple[str, tuple[ToolCall, ...]]:
    """``(content, calls)`` of a finished completion's text (see the module docstring)."""
    if OPEN not in text:
        return text, ()
    offered = {t.name for t in tools}
    calls: list[ToolCall] = []
    for block in call_blocks(text):
        if len(calls) >= MAX_CALLS:
            break
        try:
            obj = json.loads(block)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than Python goes
            continue
        if not isinstance(obj, dict) or obj.get("name") not in offered:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, dict):
            continue
        arguments = json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(call_id(stream_id, len(calls)), str(obj["name"]), arguments))
    if not calls:
        return text, ()
    return text.split(OPEN, 1)[0], tuple(calls)


def encode_calls(calls: Sequence[ToolCall]) -> str:
    """The ``done`` event's ``tc`` field: compact JSON ``[[id, name, arguments], ...]``."""
    return json.dumps([[c.id, c.name, c.arguments] for c in calls], ensure_ascii=False)


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


class CallTextFilter:
    """Streams a completion's content while holding back what may be calls.

    :meth:`feed` returns the text to show now: everything before the first
    :data:`OPEN` (a partial tag at the end waits for the next piece). From the tag
    on, text is held; :meth:`end` gives it back when the finished completion made
    no call (it was content after all), nothing when it did.
    """

    def __init__(self) -> None:
        self._pending = ""
        self._held: list[str] | None = None  # not None once OPEN was seen

    def feed(self, text: str) -> str:
        if self._held is not None:
            self._held.append(text)
            return ""
        text = self._pending + text
        self._pending = ""
        at = text.find(OPEN)
        if at >= 0:
            self._held = [text[at:]]
            return text[:at]
        for keep in range(min(len(OPEN) - 1, len(text)), 0, -1):
            if OPEN.startswith(text[-keep:]):
                self._pending = text[-keep:]
                return text[:-keep]
        return text

    def end(self, made_calls: bool) -> str:
        """What is left to show once the completion is done."""
        rest = self._pending + "".join(self._held or ())
        self._pending, self._held = "", None
        return "" if made_calls else rest
