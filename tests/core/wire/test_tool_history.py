"""A client's own tool calls in the history (core/wire/structured.py): arguments nested
deeper than Python's JSON parser goes are a 400 naming the field, never a RecursionError."""

from __future__ import annotations

import pytest

from tokenrelay.core.wire.errors import RequestError
from tokenrelay.core.wire.requests import Limits, validate_messages


@pytest.mark.parametrize("deep", ["[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1"])
def test_history_arguments_nested_too_deep_are_a_bad_request(deep: str) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": deep}}
    msg = {"role": "assistant", "content": "", "tool_calls": [call]}
    with pytest.raises(RequestError) as info:
        validate_messages([msg], Limits(max_input_chars=10**7))
    assert info.value.code == "bad_request"
    assert info.value.field == "messages[0].tool_calls[0].function.arguments"
