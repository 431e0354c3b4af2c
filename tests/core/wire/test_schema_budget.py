"""A request's schemas, bounded together before anything compiles (core/wire/schema_budget.py)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tokenrelay.core.wire.requests import Limits, RequestError, validate_params
from tokenrelay.core.wire.schema_budget import (
    DEFAULT_MAX_SCHEMA_KEYWORDS,
    SchemaBudget,
    check_schema_budget,
)


def tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    params = {"type": "object", "properties": properties}
    return {"type": "function", "function": {"name": name, "parameters": params}}


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def refused(raw: dict[str, Any], limits: Limits | None = None) -> RequestError:
    with pytest.raises(RequestError) as info:
        validate_params(raw, limits or Limits())
    return info.value


def test_a_thousand_uri_formats_in_three_tools_are_refused_before_any_compile(
    compiles: list[str],
) -> None:
    props = {f"p{i}": {"type": "string", "format": "uri"} for i in range(1000)}
    err = refused({"tools": [tool(f"t{j}", props) for j in range(3)]})
    assert err.code == "bad_request" and err.field == "tools"
    assert f"more than {DEFAULT_MAX_SCHEMA_KEYWORDS} 'format' and 'pattern'" in err.message
    assert "limit" in err.message
    assert compiles == []  # refused on the count alone


def test_the_budget_counts_tools_and_response_format_together(compiles: list[str]) -> None:
    budget = SchemaBudget(max_keywords=3)
    two = {"a": {"type": "string", "format": "uuid"}, "b": {"type": "string", "pattern": "x+"}}
    raw = {
        "tools": [tool("t", two)],
        "tool_choice": "none",
        "response_format": schema_format({"type": "object", "properties": two}),
    }
    err = refused(raw, Limits(schemas=budget))
    assert err.field == "response_format" and "more than 3" in err.message
    assert compiles == []


@pytest.mark.parametrize(
    ("budget", "words"),
    [
        (SchemaBudget(max_nodes=50), "more than 50 JSON values"),
        (SchemaBudget(max_bytes=500), "more than 500 bytes of JSON"),
    ],
)
def test_values_and_bytes_are_bounded_over_all_tools(
    compiles: list[str], budget: SchemaBudget, words: str
) -> None:
    props = {f"p{i}": {"type": "integer"} for i in range(10)}  # ~21 values, ~220 bytes each
    tools = [tool(f"t{j}", props) for j in range(3)]
    check_schema_budget({"tools": tools[:1]}, budget)  # one alone is under both
    err = refused({"tools": tools}, Limits(schemas=budget))
    assert err.code == "bad_request" and err.field == "tools" and words in err.message
    assert compiles == []


def test_the_transports_names_are_used() -> None:
    with pytest.raises(ValueError, match=r"^fmt: the schemas"):
        check_schema_budget(
            {"response_format": schema_format({"format": "uri", "pattern": "a"})},
            SchemaBudget(max_keywords=1),
            {"response_format": "fmt"},
        )


def test_a_property_named_format_is_no_keyword() -> None:
    props = {"format": {"type": "string"}, "pattern": {"type": "string"}}
    check_schema_budget({"tools": [tool("t", props)]}, SchemaBudget(max_keywords=1))


def test_the_defaults_admit_a_large_realistic_tool_set() -> None:
    run = uuid.uuid4().hex[:8]  # fresh schemas: compiled here, not taken from the cache
    props: dict[str, Any] = {
        "path": {"type": "string", "description": "Where. " * 20},
        "when": {"type": "string", "format": "date-time"},
        "limit": {"type": "integer", "minimum": 1, "maximum": 100},
        "mode": {"enum": ["fast", "slow", "auto"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "opts": {"type": "object", "properties": {"deep": {"type": "boolean"}}},
    }
    tools = [tool(f"tool_{run}_{j}", props) for j in range(100)]
    params = validate_params({"tools": tools}, Limits())
    assert params.tools is not None and len(params.tools) == 100


@pytest.mark.parametrize("field", ["max_bytes", "max_nodes", "max_keywords"])
@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_a_bad_budget_is_refused_clearly(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"SchemaBudget.{field} must be an integer >= 1"):
        SchemaBudget(**{field: value})
