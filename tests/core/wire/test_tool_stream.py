"""core/wire/tool_stream.py and tool_formats.py: calls read as the text streams.

The worker runs the reader on its engine loop for every piece of every completion that
offered tools: whatever a model (or a prompt steering it) writes, the reader must give
the same answer however the text is cut, show text that is no call, never backtrack,
and stay within its caps.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.tool_formats import ToolFormat, call_grammar, detect_format
from tokenrelay.core.wire.tool_stream import MAX_CALL_CHARS, MAX_CALLS, CallStream
from tokenrelay.core.wire.tools import Tool, ToolChoice, call_id, parse_tools

TOOLS = (Tool("get_weather"), Tool("add"))
H, L, M, G = ToolFormat.HERMES, ToolFormat.LLAMA3, ToolFormat.MISTRAL, ToolFormat.GRANITE


def read(fmt: ToolFormat, pieces: list[str]) -> tuple[str, dict[int, str], list[tuple[str, str]],
                                                      dict[int, str]]:  # fmt: skip
    """(content, arguments streamed per call, calls read whole, names streamed per call)."""
    reader = CallStream(fmt, TOOLS, "s1")
    content, args, names = "", {}, {}
    for split in [*(reader.feed(p) for p in pieces), reader.finish()]:
        content += split.content
        for d in split.deltas:
            args[d.index] = args.get(d.index, "") + d.arguments
            if d.name is not None:
                assert d.index not in names, "a call is named once"
                names[d.index] = d.name
    return content, args, [(c.name, c.arguments) for c in reader.calls], names


def cuts(text: str, every: int) -> list[str]:
    return [text[i : i + every] for i in range(0, len(text), every)] or [""]


W = '{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "days": [1, {"a": "}"}]}}'
W_ARGS = '{"city": "Pa\\"ris", "days": [1, {"a": "}"}]}'
CASES = [
    (H, f"Sure.<tool_call>\n{W}\n</tool_call>\n<tool_call>\n"
        '{"arguments": {"x": 1}, "name": "add"}\n</tool_call>',
     "Sure.", [("get_weather", W_ARGS), ("add", '{"x": 1}')]),
    (H, '<tool_call>\n{"name": "add"}\n</tool_call>', "", [("add", "{}")]),
    (L, '  {"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {}}',
     "", [("add", '{"a": 1}'), ("get_weather", "{}")]),
    (L, '<|python_tag|>{"name": "add", "parameters": {"a": 1}}', "", [("add", '{"a": 1}')]),
    (M, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", '
        '"arguments": {"c": "x"}}]', "", [("add", '{"a": 1}'), ("get_weather", '{"c": "x"}')]),
    (M, '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]get_weather[ARGS]{"c": "x"}',
     "", [("add", '{"a": 1}'), ("get_weather", '{"c": "x"}')]),
    (G, 'Checking.<|tool_call|>[{"name": "add", "arguments": {"a": [1, 2]}}]',
     "Checking.", [("add", '{"a": [1, 2]}')]),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_each_format_gives_content_calls_and_deltas_that_add_up(
    fmt: ToolFormat, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    for every in (1, 2, 3, 7, len(text)):
        got_content, args, whole, names = read(fmt, cuts(text, every))
        assert (got_content, whole) == (content, calls), every
        # the streamed fragments add up to each call's arguments, under its name
        assert [(names[i], args[i]) for i in sorted(args)] == calls


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (H, "no tags at all"),
        (H, "I write <tool_call> in prose, and <tool_ call> too"),
        (H, "<tool_call>\nnot json\n</tool_call>"),
        (H, '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call> tail'),
        (H, '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>'),
        (H, "<tool_call>" + " " * 50_000),
        (L, '  {"answer": 42}'),
        (L, 'Hello {"name": "add", "parameters": {}}'),
        (M, "[TOOL_CALLS] not really"),
        (G, "<|tool_call|>[1, 2]"),
    ],
)
def test_text_that_makes_no_call_is_all_content(fmt: ToolFormat, text: str) -> None:
    for every in (1, 5, len(text)):
        assert read(fmt, cuts(text, every))[:3] == (text, {}, [])


def test_a_calls_first_delta_waits_for_its_arguments_to_start() -> None:
    reader = CallStream(H, TOOLS, "s1")
    assert reader.feed('<tool_call>\n{"name": "add", ').deltas == []
    first = reader.feed('"arguments": {"a"').deltas
    assert [(d.index, d.name, d.arguments) for d in first] == [(0, "add", '{"a"')]
    assert [(d.index, d.name, d.arguments) for d in reader.feed(": 1}}").deltas] == [
        (0, None, ": 1}")
    ]
    assert reader.calls[0].id == call_id("s1", 0)


def test_a_call_cut_off_after_its_first_delta_is_left_out() -> None:
    content, args, calls, names = read(H, ['<tool_call>\n{"name": "add", "arguments": {"a": 1'])
    assert (content, calls, names, args) == ("", [], {0: "add"}, {0: '{"a": 1'})


FRAGMENTS = ["<tool_call>", "</tool_call>", "\n", " ", "x", "{", "}", "[", "]", '"', ",", ":",
             '"name"', '"arguments"', '"add"', '"nope"', '{"a": 1}', "\\", "<tool", "_call>",
             "[TOOL_CALLS]", "<|tool_call|>", "<|python_tag|>", "[ARGS]", "add", ";"]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(list(ToolFormat)),
    st.lists(st.sampled_from(FRAGMENTS), max_size=40),
    st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=8),
)
def test_the_answer_does_not_depend_on_where_the_text_is_cut(
    fmt: ToolFormat, parts: list[str], sizes: list[int]
) -> None:
    text = "".join(parts)
    pieces, i, k = [], 0, 0
    while i < len(text):
        pieces.append(text[i : i + sizes[k % len(sizes)]])
        i, k = i + sizes[k % len(sizes)], k + 1
    whole = read(fmt, [text])
    assert read(fmt, pieces) == whole
    content, _, calls, names = whole
    if not names:  # nothing went out as a call: every character is content
        assert content == text
    for name, arguments in calls:
        assert isinstance(json.loads(arguments), dict) and name in ("get_weather", "add")


def test_hostile_text_stays_within_the_caps() -> None:
    deep = "[" * 200_000 + "]" * 200_000
    content, _, calls, _ = read(H, [f'<tool_call>{deep}</tool_call><tool_call>{{"name": "add"}}'])
    assert content == f"<tool_call>{deep}</tool_call>" and calls == [("add", "{}")]
    huge = json.dumps({"name": "add", "arguments": {"x": "a" * MAX_CALL_CHARS}})
    assert read(H, cuts(f"<tool_call>{huge}</tool_call>", 4096))[2] == []
    many = '<tool_call>{"name": "add"}</tool_call>' * (MAX_CALLS + 10)
    assert len(read(H, [many])[2]) == MAX_CALLS
    long_value = '<tool_call>{"note": "' + "a" * MAX_CALL_CHARS + '"} and after'
    for every in (4096, 7, len(long_value)):  # over the cap: shown as it came, once
        assert read(H, cuts(long_value, every))[:3] == (long_value, {}, [])
    for filler in ("\n" * 200_000, "<tool_call> " * 30_000):
        text = "Sure. <tool_call>" + filler
        assert read(H, cuts(text, 1000))[0] == text


def test_a_template_tells_its_format() -> None:
    assert detect_format(None) == H
    assert detect_format("{{ messages }}") == H  # shows no tools: our Hermes prompt
    assert detect_format("{% for tool in tools %}<tool_call>{% endfor %}") == H
    assert detect_format("{{ tools }}[AVAILABLE_TOOLS][TOOL_CALLS]") == M
    assert detect_format("{{ tools }}<|tool_call|>") == G
    llama = '<|start_header_id|>{{ tools }}"parameters"<|python_tag|>'
    assert detect_format(llama) == L


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_each_formats_grammar_compiles_and_the_engine_gets_it(fmt: ToolFormat) -> None:
    llguidance = pytest.importorskip("llguidance")
    tools = parse_tools([{"type": "function", "function": {"name": "add"}}])
    for choice, parallel in ((ToolChoice("required"), True), (ToolChoice("function", "add"), True)):
        lark = call_grammar(tools, choice, parallel, fmt)
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        assert llguidance.LLMatcher.validate_grammar(grammar, None) == ""
    p = SamplingParams(tools=[tools[0].to_dict()], tool_choice="required")
    guided = p.guided_for(fmt)
    assert guided is not None and guided.type == "tool_calls"
    assert (guided == p.guided) == (fmt == H)
