"""llguidance's verdict on a schema: once per schema, cached, deferred (schema_verdicts.py)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tokenrelay.core.wire import schema_verdicts
from tokenrelay.core.wire.errors import ResponseFormatError
from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.requests import Limits, RequestError, validate_params
from tokenrelay.core.wire.response_format import parse_response_format
from tokenrelay.core.wire.schema_verdicts import (
    VerdictCache,
    deferred_verdicts,
    schema_key,
)


def fresh(schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``response_format`` no test has checked before (a unique property name)."""
    body = schema or {"type": "object", "properties": {"a": {"type": "string"}}}
    body = {**body, "title": f"t-{uuid.uuid4().hex}"}  # an annotation: changes the text only
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": body}}


def test_a_second_identical_schema_is_not_compiled_again(compiles: list[str]) -> None:
    fmt = fresh()
    first = validate_params({"response_format": fmt}, Limits())
    assert len(compiles) == 1  # the validator and SamplingParams share the verdict
    second = validate_params({"response_format": fmt}, Limits())
    SamplingParams(response_format=fmt)
    assert len(compiles) == 1 and first.guided == second.guided


def test_a_refusal_is_cached_with_its_message(compiles: list[str]) -> None:
    fmt = fresh({"oneOf": [{"type": "integer"}, {"type": "number"}]})
    errors = []
    for _ in range(3):
        with pytest.raises(RequestError) as info:
            validate_params({"response_format": fmt}, Limits())
        errors.append(info.value)
    assert len(compiles) == 1
    assert {e.message for e in errors} == {errors[0].message}
    assert "oneOf constraints" in errors[0].message
    assert errors[0].field == "response_format.json_schema.schema"


def test_deferred_verdicts_are_recorded_once_and_not_computed(compiles: list[str]) -> None:
    fmt = fresh({"oneOf": [{"type": "integer"}, {"type": "number"}]})  # refused, once computed
    with deferred_verdicts() as pending:
        validate_params({"response_format": fmt}, Limits())  # passes: the verdict waits
        SamplingParams(response_format=fmt)
    assert compiles == []
    (one,) = pending
    assert one.field == "response_format.json_schema.schema"
    assert one.key == schema_key(one.text)
    assert schema_verdicts.compute_verdict(one.key, one.text).startswith("oneOf")
    with pytest.raises(ResponseFormatError, match="oneOf constraints"):
        parse_response_format(fmt)  # outside the block: from the cache now
    assert len(compiles) == 1


def test_a_cached_verdict_is_used_even_when_deferring(compiles: list[str]) -> None:
    fmt = fresh()
    parse_response_format(fmt)
    with deferred_verdicts() as pending:
        parse_response_format(fmt)
    assert pending == [] and len(compiles) == 1


def test_the_verdict_of_a_tool_schema_is_shared_with_its_response_format(
    compiles: list[str],
) -> None:
    schema = fresh()["json_schema"]["schema"]  # the compact text is the key, whatever the field
    tools = [
        {"type": "function", "function": {"name": name, "parameters": schema}}
        for name in ("f", "g")
    ]
    validate_params({"tools": tools}, Limits())
    parse_response_format({"type": "json_schema", "json_schema": {"schema": schema}})
    assert len(compiles) == 1


def test_the_cache_is_a_bounded_lru() -> None:
    cache = VerdictCache(2)
    cache.put("a", "")
    cache.put("b", "bad")
    assert cache.get("a") == ""  # a is now the most recent
    cache.put("c", "")
    assert cache.get("b") is None and cache.get("a") == "" and cache.get("c") == ""
    assert cache.info()["entries"] == 2


@pytest.mark.parametrize("size", [0, -1, True, 2.0])
def test_a_bad_cache_size_is_refused(size: Any) -> None:
    with pytest.raises(ValueError, match="VerdictCache size"):
        VerdictCache(size)
