"""core/wire/response_format.py: the OpenAI shapes parsed, bad schemas refused by field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenrelay.core.wire.errors import ResponseFormatError
from tokenrelay.core.wire.response_format import (
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    UNSUPPORTED_KEYWORDS,
    ResponseFormat,
    parse_response_format,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40, "description": "full name"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "boss": {"anyOf": [{"$ref": "#/$defs/ref"}, {"type": "null"}]},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
    "$defs": {"ref": {"type": "object", "properties": {"id": {"type": "integer"}}}},
    "title": "Person",
}


def schema_format(schema: Any, **spec: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, **spec}}


def refused(value: Any) -> ResponseFormatError:
    with pytest.raises(ResponseFormatError) as info:
        parse_response_format(value)
    return info.value


def test_text_and_absent_are_no_constraint() -> None:
    assert parse_response_format(None) is None
    assert parse_response_format({"type": "text"}) is None


def test_json_object() -> None:
    fmt = parse_response_format({"type": "json_object"})
    assert fmt == ResponseFormat("json_object")
    assert fmt.key == "json_object"
    assert fmt.to_dict() == {"type": "json_object"}


def test_json_schema_kept_compact_in_its_key_order() -> None:
    fmt = parse_response_format(schema_format(PERSON, strict=True, description="a person"))
    assert fmt is not None and fmt.type == "json_schema" and fmt.name == "person"
    assert fmt.schema == json.dumps(PERSON, separators=(",", ":"))
    assert list(json.loads(fmt.schema)["properties"]) == ["name", "age", "role", "tags", "boss"]
    assert fmt.key == "json_schema:" + fmt.schema
    # what the worker's request carries parses back to the same format
    assert parse_response_format(fmt.to_dict()) == fmt


def test_name_is_optional_and_the_key_ignores_it() -> None:
    a = parse_response_format({"type": "json_schema", "json_schema": {"schema": PERSON}})
    b = parse_response_format(schema_format(PERSON))
    assert a is not None and b is not None and a.name is None
    assert a.key == b.key


@pytest.mark.parametrize(
    ("value", "field", "words"),
    [
        ("json", "response_format", "must be an object"),
        ({"type": "regex"}, "response_format.type", "'text', 'json_object' or 'json_schema'"),
        ({}, "response_format.type", "got None"),
        ({"type": "json_object", "schema": {}}, "response_format.schema", "unknown field"),
        ({"type": "json_schema"}, "response_format.json_schema", "must be an object"),
        (
            {"type": "json_schema", "json_schema": {"name": "x"}},
            "response_format.json_schema.schema",
            "must be an object, got null",
        ),
        (schema_format([]), "response_format.json_schema.schema", "got an array"),
        (
            schema_format(PERSON, extra=1),
            "response_format.json_schema.extra",
            "unknown field",
        ),
        (schema_format(PERSON, strict="yes"), "response_format.json_schema.strict", "boolean"),
        (
            {"type": "json_schema", "json_schema": {"name": "a b", "schema": PERSON}},
            "response_format.json_schema.name",
            "a-z",
        ),
    ],
)
def test_malformed_response_formats_name_their_field(value: Any, field: str, words: str) -> None:
    err = refused(value)
    assert err.field == field and err.code == "bad_request"
    assert words in str(err) and str(err).startswith(field + ": ")


@pytest.mark.parametrize("keyword", sorted(UNSUPPORTED_KEYWORDS))
def test_every_unsupported_keyword_is_refused_where_it_is(keyword: str) -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array", keyword: True}}}
    err = refused(schema_format(schema))
    assert err.field == "response_format.json_schema.schema"
    assert f"keyword {keyword!r} is not supported (at /properties/tags)" in str(err)


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "string", "format": "iri"}, "format 'iri' is not supported"),
        ({"type": "array", "items": [{"type": "string"}]}, "prefixItems"),
        ({"$ref": "https://example.com/s.json"}, "$ref must point inside"),
        ({"type": "text"}, "type must be one of"),
        ({"type": []}, "type must be one of"),
        ({"type": "string", "maxLength": -1}, "maxLength must be a non-negative integer"),
        ({"type": "string", "minLength": 1.5}, "minLength must be a non-negative integer"),
        ({"type": "integer", "minimum": "0"}, "minimum must be a number"),
        ({"type": "integer", "exclusiveMinimum": True}, "exclusiveMinimum must be a number"),
        ({"type": "number", "multipleOf": 0}, "multipleOf must be greater than 0"),
        ({"enum": []}, "enum must be a non-empty array"),
        ({"type": "object", "required": "a"}, "required must be an array of strings"),
        ({"anyOf": []}, "anyOf must be a non-empty array"),
        ({"properties": []}, "properties must be an object"),
        (
            {"properties": {"a": 3}},
            "must be an object or a boolean, got a number (at /properties/a)",
        ),
        ({"type": "string", "pattern": 3}, "pattern must be a string"),
        ({"$defs": {"a/b": {"not": {}}}}, "(at /$defs/a~1b)"),
        ({"prefixItems": [True, {"uniqueItems": True}]}, "(at /prefixItems/1)"),
    ],
)
def test_bad_schemas_are_refused_with_a_pointer(schema: dict[str, Any], words: str) -> None:
    err = refused(schema_format(schema))
    assert err.code == "bad_request"
    assert words in str(err)


def test_annotations_booleans_and_unknown_keywords_pass() -> None:
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": ["object", "null"],
        "properties": {"a": True, "b": {"examples": [1], "default": 2, "x-ui": {"w": 3}}},
        "additionalProperties": False,
        "format_hint": "ignored",
    }
    assert parse_response_format(schema_format(schema)) is not None


def test_size_bounds_are_too_large() -> None:
    big = {"type": "object", "description": "x" * MAX_SCHEMA_BYTES}
    err = refused(schema_format(big))
    assert err.code == "too_large" and f"more than {MAX_SCHEMA_BYTES}" in str(err)
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH // 2):  # two levels each: the schema, its "items"
        deep = {"type": "array", "items": deep}
    assert parse_response_format(schema_format(deep)) is not None
    for _ in range(1000):  # far beyond: refused before anything recurses
        deep = {"type": "array", "items": deep}
    err = refused(schema_format(deep))
    assert err.code == "too_large" and "levels deep" in str(err)
    wide = {"enum": list(range(MAX_SCHEMA_NODES))}
    err = refused(schema_format(wide))
    assert err.code == "too_large" and "JSON values" in str(err)


def test_non_json_values_are_refused() -> None:
    err = refused(schema_format({"type": "number", "maximum": float("nan")}))
    assert "not JSON" in str(err)
    err = refused(schema_format({"type": "number", "const": {1, 2}}))
    assert "not JSON" in str(err)


def test_the_field_name_is_the_callers() -> None:
    with pytest.raises(ResponseFormatError) as info:
        parse_response_format({"type": "nope"}, field="params.response_format")
    assert info.value.field == "params.response_format.type"


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf constraints"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, "Unsatisfiable"),
        ({"$ref": "#/$defs/missing"}, "/$defs/missing"),
        (
            {"type": "object", "required": ["b"], "additionalProperties": False},
            "required property 'b' is unsatisfiable",
        ),
    ],
)
def test_what_llguidance_cannot_compile_is_refused_here(schema: dict[str, Any], words: str) -> None:
    err = refused(schema_format(schema))
    assert err.code == "bad_request" and err.field == "response_format.json_schema.schema"
    assert words in str(err) and "\n" not in str(err)


def test_a_disjoint_one_of_passes() -> None:
    schema = {"oneOf": [{"type": "integer"}, {"type": "string"}]}
    assert parse_response_format(schema_format(schema)) is not None
