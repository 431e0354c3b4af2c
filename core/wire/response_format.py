"""A request's ``response_format``: parsed, checked and bounded before anyone compiles it.

The OpenAI shapes, for the HTTP API and the WebSocket ``params`` alike:

* ``{"type": "text"}`` (or no field): free text, no constraint;
* ``{"type": "json_object"}``: any JSON object;
* ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...,
  "description": ...}}``: JSON valid against ``schema``.

:func:`parse_response_format` turns one into a :class:`ResponseFormat` (``None`` for
text) or raises :class:`ResponseFormatError` naming the offending field and, inside a
schema, the JSON pointer of the offending keyword. Sans I/O and torch-free, so the
gateway refuses a bad schema with a 400 before it queues anything; the engine
(``engine/guided/``) compiles what passes with llguidance (imported here only for its
check, no tokenizer, no torch).

The checks are the ones a user can act on before a grammar is built:

* size: at most :data:`MAX_SCHEMA_BYTES` of compact JSON, :data:`MAX_SCHEMA_DEPTH`
  levels of nesting and :data:`MAX_SCHEMA_NODES` JSON values in all (the grammar's size
  and its compile time grow with these; an oversize schema is ``too_large``);
* keywords the grammar engine cannot enforce (:data:`UNSUPPORTED_KEYWORDS`), so that no
  constraint of the schema is dropped in silence; annotations (``title``,
  ``description``, ``default``, ``examples``...) and unknown keywords are ignored, as
  JSON Schema itself ignores them;
* string formats other than :data:`FORMATS`; remote ``$ref``; the draft-7 array form
  of ``items`` (use ``prefixItems``); keyword values of the wrong type;
* last, llguidance's own check of the schema without a tokenizer (what it cannot
  express exactly, such as an overlapping ``oneOf``, or an unsatisfiable schema), so
  that what passes here compiles in the engine: one verdict per distinct schema, cached
  for the process, and deferred off the caller's event loop where it asks
  (core/wire/schema_verdicts.py). All of a request's schemas together are bounded
  before any of this (core/wire/schema_budget.py).

``ResponseFormat.schema`` keeps the schema as compact JSON text with its key order
(the order of ``properties`` is the order the fields are generated in): that text is
also the compile cache's key, and what travels to the worker.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tokenrelay.core.wire.errors import ResponseFormatError
from tokenrelay.core.wire.schema_verdicts import GRAMMAR_OPTIONS, verdict
from tokenrelay.core.wire.vocabulary import ErrorCode

__all__ = [
    "FORMATS",
    "GRAMMAR_OPTIONS",
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "MAX_SCHEMA_NODES",
    "UNSUPPORTED_KEYWORDS",
    "ResponseFormat",
    "ResponseFormatError",
    "check_schema",
    "parse_response_format",
]

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_SCHEMA_NODES = 4096
MAX_NAME = 64
_NAME_RE = re.compile(r"[A-Za-z0-9_-]+")

# Keywords llguidance 1.9 refuses ("Unimplemented keys") or cannot express exactly.
UNSUPPORTED_KEYWORDS = frozenset(
    {
        *("not", "if", "then", "else", "dependentSchemas", "dependentRequired"),
        *("propertyNames", "unevaluatedProperties", "unevaluatedItems"),
        *("contains", "minContains", "maxContains", "uniqueItems", "additionalItems"),
        *("$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor"),
    }
)
FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"}
)
TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_ONE = ("items", "additionalProperties")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_JSON_SCHEMA_FIELDS = frozenset({"name", "schema", "strict", "description"})


@dataclass(frozen=True)
class ResponseFormat:
    """A checked constraint on the output: ``json_object``, or ``json_schema`` + ``schema``.

    ``schema`` is compact JSON text (key order kept); ``name`` the client's schema name.
    """

    type: str
    schema: str | None = None
    name: str | None = None

    @property
    def key(self) -> str:
        """What identifies the grammar (the compile cache's key)."""
        return self.type if self.schema is None else f"{self.type}:{self.schema}"

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI shape again (what the worker's request carries); parses back equal."""
        if self.type != "json_schema" or self.schema is None:
            return {"type": self.type}
        spec: dict[str, Any] = {"schema": json.loads(self.schema)}
        if self.name is not None:
            spec["name"] = self.name
        return {"type": "json_schema", "json_schema": spec}


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    return "a string" if isinstance(value, str) else "a number"


def parse_response_format(value: Any, field: str = "response_format") -> ResponseFormat | None:
    """``value`` (the request's field, JSON-decoded) as a :class:`ResponseFormat`.

    ``None`` and ``{"type": "text"}`` give ``None`` (no constraint). ``field`` is the
    name errors use for the whole value. Raises :class:`ResponseFormatError`.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ResponseFormatError(f"must be an object, got {_kind(value)}", field)
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        message = f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
        raise ResponseFormatError(message, f"{field}.type")
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    extra = sorted(set(value) - allowed)
    if extra:
        raise ResponseFormatError(f"unknown field for type {kind!r}", f"{field}.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    return _json_schema(value.get("json_schema"), f"{field}.json_schema")


def _json_schema(spec: Any, field: str) -> ResponseFormat:
    if not isinstance(spec, dict):
        raise ResponseFormatError(f"must be an object, got {_kind(spec)}", field)
    extra = sorted(set(spec) - _JSON_SCHEMA_FIELDS)
    if extra:
        raise ResponseFormatError("unknown field", f"{field}.{extra[0]}")
    name = spec.get("name")
    if name is not None and (
        not isinstance(name, str) or len(name) > MAX_NAME or not _NAME_RE.fullmatch(name)
    ):
        message = f"must be 1 to {MAX_NAME} of a-z, A-Z, 0-9, '_' and '-'"
        raise ResponseFormatError(message, f"{field}.name")
    if "strict" in spec and not isinstance(spec["strict"], bool | None):
        raise ResponseFormatError("must be a boolean", f"{field}.strict")
    if "description" in spec and not isinstance(spec["description"], str | None):
        raise ResponseFormatError("must be a string", f"{field}.description")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ResponseFormatError(f"must be an object, got {_kind(schema)}", f"{field}.schema")
    return ResponseFormat("json_schema", check_schema(schema, f"{field}.schema"), name)


def check_schema(schema: dict[str, Any], field: str) -> str:
    """Check ``schema`` (see the module docstring); returns its compact JSON text."""
    _check_size(schema, field)  # first: bounds the depth json.dumps recurses to
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ResponseFormatError(f"not JSON: {exc}", field) from exc
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        message = f"is {len(text.encode())} bytes of JSON, more than {MAX_SCHEMA_BYTES}"
        raise ResponseFormatError(message, field, ErrorCode.TOO_LARGE)
    _check(schema, "", field)
    _check_compiles(text, field)
    return text


def _check_compiles(text: str, field: str) -> None:
    """llguidance's own verdict on the schema, without a tokenizer: what passes here, the
    engine compiles. Cached per schema, and deferred where the caller asked
    (core/wire/schema_verdicts.py)."""
    error = verdict(text, field)
    if error:
        raise ResponseFormatError(error, field)


def _check_size(schema: Any, field: str) -> None:
    """At most MAX_SCHEMA_NODES values, MAX_SCHEMA_DEPTH levels (iterative, stops early)."""
    stack: list[tuple[Any, int]] = [(schema, 0)]
    nodes = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            message = f"holds more than {MAX_SCHEMA_NODES} JSON values"
            raise ResponseFormatError(message, field, ErrorCode.TOO_LARGE)
        if depth > MAX_SCHEMA_DEPTH:
            message = f"is nested more than {MAX_SCHEMA_DEPTH} levels deep"
            raise ResponseFormatError(message, field, ErrorCode.TOO_LARGE)
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def _check(node: Any, pointer: str, field: str) -> None:
    """One subschema at JSON pointer ``pointer`` (its depth bounded by _check_size)."""
    where = pointer or "/"

    def bad(message: str) -> ResponseFormatError:
        return ResponseFormatError(f"{message} (at {where})", field)

    if isinstance(node, bool):
        return  # true / false schemas
    if not isinstance(node, dict):
        raise bad(f"a schema must be an object or a boolean, got {_kind(node)}")
    for key in node:
        if key in UNSUPPORTED_KEYWORDS:
            raise bad(f"keyword {key!r} is not supported")
    _check_values(node, bad)
    for key in _SCHEMA_ONE:
        if key in node:
            _check(node[key], f"{pointer}/{key}", field)
    for key in _SCHEMA_LISTS:
        if key in node:
            items = node[key]
            if not isinstance(items, list) or not items:
                raise bad(f"{key} must be a non-empty array of schemas")
            for i, sub in enumerate(items):
                _check(sub, f"{pointer}/{key}/{i}", field)
    for key in _SCHEMA_MAPS:
        if key in node:
            subs = node[key]
            if not isinstance(subs, dict):
                raise bad(f"{key} must be an object of schemas")
            for name, sub in subs.items():
                escaped = name.replace("~", "~0").replace("/", "~1")
                _check(sub, f"{pointer}/{key}/{escaped}", field)


def _check_values(node: dict[str, Any], bad: Any) -> None:
    """The values of one schema's validation keywords."""
    kind = node.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in TYPES for k in kinds):
            raise bad(f"type must be one of {', '.join(sorted(TYPES))}, or an array of them")
    if isinstance(node.get("items"), list):
        raise bad("items must be a schema; write a tuple as prefixItems")
    if "format" in node and node["format"] not in FORMATS:
        names = ", ".join(sorted(FORMATS))
        raise bad(f"format {node['format']!r} is not supported (supported: {names})")
    ref = node.get("$ref")
    if ref is not None and (not isinstance(ref, str) or not ref.startswith("#")):
        raise bad("$ref must point inside the schema ('#/$defs/...')")
    for key in _COUNTS:
        value = node.get(key)
        if key in node and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise bad(f"{key} must be a non-negative integer")
    for key in _NUMBERS:
        value = node.get(key)
        if key in node and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise bad(f"{key} must be a number")
    if "multipleOf" in node and not node["multipleOf"] > 0:
        raise bad("multipleOf must be greater than 0")
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise bad("enum must be a non-empty array")
    required = node.get("required")
    if "required" in node and (
        not isinstance(required, list) or not all(isinstance(r, str) for r in required)
    ):
        raise bad("required must be an array of strings")
    if "pattern" in node and not isinstance(node["pattern"], str):
        raise bad("pattern must be a string")
