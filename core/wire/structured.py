"""The request fields that shape the output rather than sample it, checked sans I/O.

``response_format`` (core/wire/response_format.py), ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (core/wire/tools.py) as :func:`core.wire.requests.validate_params`
takes them, and the tool fields of chat messages (an assistant turn's ``tool_calls``, a
``tool`` turn's ``tool_call_id``) as :func:`core.wire.requests.validate_messages` takes
them. Errors are :class:`~core.wire.response_format.ResponseFormatError` s naming the
field (the validators turn them into ``RequestError`` s). All of a request's schemas
together are held to a :class:`~core.wire.schema_budget.SchemaBudget` first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tokenrelay.core.wire.errors import ResponseFormatError, ToolError
from tokenrelay.core.wire.response_format import parse_response_format
from tokenrelay.core.wire.schema_budget import SchemaBudget, check_schema_budget
from tokenrelay.core.wire.tools import parse_tool_choice, parse_tools

__all__ = ["MAX_CALLS_PER_MESSAGE", "message_tool_fields", "structured_params"]

MAX_CALLS_PER_MESSAGE = 64
MAX_CALL_ID = 128


def structured_params(
    raw: Mapping[str, Any],
    names: Mapping[str, str],
    ignore_eos: bool,
    budget: SchemaBudget | None = None,
) -> dict[str, Any]:
    """The SamplingParams keyword arguments of these fields in ``raw`` (checked).

    ``budget``: what the schemas of ``tools`` and ``response_format`` may cost together,
    checked first, before any schema is compiled (core/wire/schema_budget.py).
    """
    check_schema_budget(raw, budget or SchemaBudget(), names)
    kw: dict[str, Any] = {}
    fmt_name = names.get("response_format", "response_format")
    if raw.get("response_format") is not None:
        fmt = parse_response_format(raw["response_format"], fmt_name)
        if fmt is not None and ignore_eos:
            raise ResponseFormatError("cannot be combined with ignore_eos", fmt_name)
        kw["response_format"] = raw["response_format"]
    tools = parse_tools(raw.get("tools"), names.get("tools", "tools"))
    choice_name = names.get("tool_choice", "tool_choice")
    choice = parse_tool_choice(raw.get("tool_choice"), tools, choice_name)
    parallel = raw.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(
            "must be a boolean", names.get("parallel_tool_calls", "parallel_tool_calls")
        )
    if tools:
        kw["tools"] = raw["tools"]
        if choice.mode != "none" and kw.get("response_format") is not None:
            raise ToolError("cannot be combined with tools unless tool_choice is 'none'", fmt_name)
        if choice.constrained and ignore_eos:
            raise ToolError(f"{choice.mode!r} cannot be combined with ignore_eos", choice_name)
    if raw.get("tool_choice") is not None:
        kw["tool_choice"] = choice.to_value()
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    return kw


def _call(raw: Any, field: str) -> dict[str, Any]:
    """One ``tool_calls`` entry of an assistant message, in OpenAI's shape."""
    if not isinstance(raw, dict) or raw.get("type", "function") != "function":
        raise ToolError("must be an object with type 'function'", field)
    call_id = raw.get("id")
    if not isinstance(call_id, str) or not 0 < len(call_id) <= MAX_CALL_ID:
        raise ToolError(f"must be a string of 1 to {MAX_CALL_ID} characters", f"{field}.id")
    fn = raw.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolError("must be an object with a 'name'", f"{field}.function")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        raise ToolError("must be a string of JSON", f"{field}.function.arguments")
    try:
        json.loads(args)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python goes
        raise ToolError("is not valid JSON", f"{field}.function.arguments") from None
    return {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}}


def message_tool_fields(m: Mapping[str, Any], index: int, role: str) -> dict[str, Any]:
    """The tool fields of message ``index`` (role already mapped) for the worker."""
    out: dict[str, Any] = {}
    calls = m.get("tool_calls")
    field = f"messages[{index}].tool_calls"
    if calls is not None:
        if role != "assistant":
            raise ToolError("only an assistant message makes tool calls", field)
        if not isinstance(calls, list) or len(calls) > MAX_CALLS_PER_MESSAGE:
            raise ToolError(f"must be an array of at most {MAX_CALLS_PER_MESSAGE} calls", field)
        if calls:
            out["tool_calls"] = [_call(c, f"{field}[{j}]") for j, c in enumerate(calls)]
    call_id = m.get("tool_call_id")
    field = f"messages[{index}].tool_call_id"
    if role == "tool":
        if not isinstance(call_id, str) or not 0 < len(call_id) <= MAX_CALL_ID:
            raise ToolError(f"a tool message needs a tool_call_id (1 to {MAX_CALL_ID})", field)
        out["tool_call_id"] = call_id
    elif call_id is not None:
        raise ToolError("only a tool message answers a tool call", field)
    return out
