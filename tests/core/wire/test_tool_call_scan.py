"""core/wire/tools.py: calls are found by one linear scan, bounded, whatever the text.

The worker parses every finished completion that was offered tools, on its engine loop
with the GIL held: text a model (or a hostile prompt steering it) writes must not make
the parse super-linear, nor raise.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenrelay.core.wire.tools import (
    CLOSE,
    MAX_CALL_CHARS,
    MAX_CALLS,
    OPEN,
    Tool,
    call_blocks,
    parse_tool_calls,
)

TOOLS = (Tool("get_weather"),)
# what the blocks always meant: the first close after each open, whitespace stripped
REFERENCE = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@given(st.lists(st.sampled_from([OPEN, CLOSE, " ", "\n", "x", "{}", "<", "tool_call>"]),
                max_size=30))  # fmt: skip
def test_the_scan_finds_what_the_pattern_found(parts: list[str]) -> None:
    text = "".join(parts)
    assert call_blocks(text) == [m.group(1) for m in REFERENCE.finditer(text)]


def test_long_whitespace_and_no_close_is_no_call() -> None:
    for filler in (" " * 200_000, "\n" * 200_000, (OPEN + " ") * 50_000):
        text = "Sure. " + OPEN + filler
        assert parse_tool_calls(text, TOOLS, "s") == (text, ())


def test_json_nested_deeper_than_python_goes_is_no_call() -> None:
    deep = "[" * 200_000 + "]" * 200_000
    text = f"{OPEN}{deep}{CLOSE}{OPEN}{CALL}{CLOSE}"
    content, calls = parse_tool_calls(text, TOOLS, "s")
    assert content == "" and [c.name for c in calls] == ["get_weather"]


def test_a_block_over_the_cap_is_never_parsed() -> None:
    huge = json.dumps({"name": "get_weather", "arguments": {"x": "a" * MAX_CALL_CHARS}})
    assert parse_tool_calls(f"{OPEN}{huge}{CLOSE}", TOOLS, "s")[1] == ()
    assert len(parse_tool_calls(f"{OPEN}{CALL}{CLOSE}", TOOLS, "s")[1]) == 1


def test_at_most_max_calls_are_parsed() -> None:
    text = f"{OPEN}{CALL}{CLOSE}" * (MAX_CALLS + 10)
    assert len(parse_tool_calls(text, TOOLS, "s")[1]) == MAX_CALLS


def test_history_arguments_nested_too_deep_are_a_bad_request() -> None:
    """A client's own tool-call arguments in the history: a 400 naming the field."""
    from tokenrelay.core.wire.errors import RequestError
    from tokenrelay.core.wire.requests import Limits, validate_messages

    deep = "[" * 100_000 + "]" * 100_000
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": deep}}
    msg = {"role": "assistant", "content": "", "tool_calls": [call]}
    with pytest.raises(RequestError) as info:
        validate_messages([msg], Limits(max_input_chars=10**7))
    assert info.value.code == "bad_request" and "arguments" in (info.value.field or "")
