"""What one request's JSON schemas may cost, measured before anything is compiled.

A grammar's compile time grows with its schema: the JSON values it holds and, above all,
its ``format`` and ``pattern`` keywords (each a regular expression the grammar engine
builds a lexer for: a thousand ``"format": "uri"`` take seconds). Every schema is
bounded on its own (core/wire/response_format.py: 64 KiB, 4096 values); a
:class:`SchemaBudget` bounds them *together*, over ``tools`` (each function's
``parameters``) and ``response_format`` (its ``json_schema.schema``), so that a request
cannot buy seconds of compile time with many schemas each under the per-schema limits.

:func:`check_schema_budget` walks the raw request fields once, iteratively and stopping
as soon as a limit is passed: a few microseconds for a realistic tool set, and no more
than the budget for a hostile one. It runs before any other schema check, so an
over-budget request is refused before anything is compiled. The defaults admit every
realistic tool set (a hundred tools of a few hundred values each).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tokenrelay.core.wire.errors import ResponseFormatError

__all__ = [
    "DEFAULT_MAX_SCHEMA_KEYWORDS",
    "DEFAULT_MAX_SCHEMA_NODES",
    "DEFAULT_MAX_SCHEMA_TOTAL_BYTES",
    "SchemaBudget",
    "check_schema_budget",
]

DEFAULT_MAX_SCHEMA_TOTAL_BYTES = 256 * 1024  # compact JSON of all the request's schemas
DEFAULT_MAX_SCHEMA_NODES = 16_384  # JSON values in all of them
DEFAULT_MAX_SCHEMA_KEYWORDS = 128  # "format" and "pattern" keywords in all of them
COSTLY_KEYWORDS = ("format", "pattern")  # each compiles to a regular expression


@dataclass(frozen=True)
class SchemaBudget:
    """Limits on all the JSON schemas of one request together (``tools`` + ``response_format``).

    ``max_bytes``: their compact JSON; ``max_nodes``: the JSON values they hold;
    ``max_keywords``: their ``format`` and ``pattern`` keywords.
    """

    max_bytes: int = DEFAULT_MAX_SCHEMA_TOTAL_BYTES
    max_nodes: int = DEFAULT_MAX_SCHEMA_NODES
    max_keywords: int = DEFAULT_MAX_SCHEMA_KEYWORDS

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_nodes", "max_keywords"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SchemaBudget.{name} must be an integer >= 1, got {value!r}")


def _schemas(raw: Mapping[str, Any], names: Mapping[str, str]) -> Iterator[tuple[str, Any]]:
    """``(field, schema)`` of each schema the request carries, as sent (unchecked)."""
    tools = raw.get("tools")
    if isinstance(tools, list):
        for tool in tools:
            fn = tool.get("function") if isinstance(tool, dict) else None
            params = fn.get("parameters") if isinstance(fn, dict) else None
            if params is not None:
                yield names.get("tools", "tools"), params
    fmt = raw.get("response_format")
    spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if schema is not None:
        yield names.get("response_format", "response_format"), schema


def _over(field: str, what: str) -> ResponseFormatError:
    """The refusal of a request whose schemas (``tools`` and ``response_format``
    together) are over one limit of the budget."""
    message = f"the schemas of tools and response_format together {what} (a request's limit)"
    return ResponseFormatError(message, field)


def check_schema_budget(
    raw: Mapping[str, Any], budget: SchemaBudget, names: Mapping[str, str] | None = None
) -> None:
    """Refuse (``bad_request``, naming the limit) the schemas of ``raw`` over ``budget``.

    ``raw``: the request's fields as sent (``tools``, ``response_format``); ``names``: the
    transport's names for them in errors (the refusal names the field whose schema went
    over). Shapes are not checked here (the validators that follow do that); only what
    the schemas would cost. Raises :class:`~core.wire.errors.ResponseFormatError`.
    """
    nodes = keywords = size = 0
    for field, schema in _schemas(raw, names or {}):
        stack = [schema]
        while stack:
            value = stack.pop()
            nodes += 1
            if nodes > budget.max_nodes:
                raise _over(field, f"hold more than {budget.max_nodes} JSON values")
            if isinstance(value, dict):
                keywords += sum(1 for k in COSTLY_KEYWORDS if isinstance(value.get(k), str))
                if keywords > budget.max_keywords:
                    what = f"use more than {budget.max_keywords} 'format' and 'pattern' keywords"
                    raise _over(field, what)
                stack.extend(value.values())
            elif isinstance(value, list):
                stack.extend(value)
        try:  # bounded: the walk above stopped at max_nodes values
            size += len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode())
        except (TypeError, ValueError, RecursionError):
            continue  # not JSON: the schema checks that follow say so
        if size > budget.max_bytes:
            raise _over(field, f"are more than {budget.max_bytes} bytes of JSON")
