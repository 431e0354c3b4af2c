"""response_format on SamplingParams and the shared validator (the WebSocket ``params``)."""

from __future__ import annotations

import dataclasses

import pytest

from tokenrelay.core.wire.errors import RequestError
from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.requests import Limits, validate_params

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}


def test_params_keep_the_normalised_format_and_parse_it() -> None:
    p = SamplingParams(response_format=FORMAT)
    assert p.guided is not None and p.guided.type == "json_schema"
    assert p.response_format == {
        "type": "json_schema",
        "json_schema": {"schema": SCHEMA, "name": "a"},
    }
    again = SamplingParams(**dataclasses.asdict(p))  # what travels to the worker
    assert again == p and again.guided == p.guided
    assert "_guided" not in dataclasses.asdict(p)


def test_text_and_none_are_no_constraint() -> None:
    assert SamplingParams(response_format={"type": "text"}).response_format is None
    assert SamplingParams().guided is None
    assert SamplingParams(response_format={"type": "json_object"}).guided is not None


def test_ignore_eos_with_a_format_is_refused() -> None:
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, response_format={"type": "json_object"})
    with pytest.raises(RequestError) as info:
        validate_params({"ignore_eos": True, "response_format": FORMAT}, Limits())
    assert info.value.field == "response_format"


def test_validator_accepts_and_names_the_bad_field() -> None:
    assert validate_params({"response_format": FORMAT}, Limits()).guided is not None
    with pytest.raises(RequestError) as info:
        validate_params({"response_format": {"type": "yaml"}}, Limits())
    assert info.value.code == "bad_request" and info.value.field == "response_format.type"
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "not": {}}}}
    with pytest.raises(RequestError) as info:
        validate_params({"response_format": bad}, Limits())
    assert info.value.field == "response_format.json_schema.schema"
    assert "'not'" in info.value.message
