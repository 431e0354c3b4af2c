"""worker/outbox.py with tools: each token event stores its content and call deltas as
the text streams, and a worker that takes over the stream goes on with the same calls."""

from __future__ import annotations

from tokenrelay.core.wire.events import Event, event_from_fields
from tokenrelay.core.wire.tools import Tool, decode_calls, decode_deltas, render_call
from tokenrelay.core.wire.vocabulary import EventKind, FinishReason, ToolFormat
from tokenrelay.worker.outbox import Active

TOOLS = (Tool("get_time"), Tool("add"))
TEXT = (
    "One moment.\n"
    + render_call("get_time", {"zone": "UTC"})
    + "\n"
    + render_call("add", {"a": 1, "b": [2, 3]})
)
PIECES = [TEXT[i : i + 3] for i in range(0, len(TEXT), 3)]


def decoded(flat_events: list[list[str]], first_seq: int = 1) -> list[Event]:
    return [
        event_from_fields(seq, dict(zip(flat[::2], flat[1::2], strict=True)))
        for seq, flat in enumerate(flat_events, start=first_seq)
    ]


def run(pieces: list[str], before: list[str] | None = None) -> list[Event]:
    before = before or []
    a = Active("s1", None, "1-0", 30.0, 600.0, text=list(before))
    a.read_calls(TOOLS, ToolFormat.HERMES)
    flat = [a.token_event(p, with_ids=True) for p in pieces]
    flat += a.finish_events(FinishReason.STOP, 5, len(before) + len(pieces), None)
    return decoded(flat, len(before) + 1)


def summary(events: list[Event]) -> tuple[str, str, list[tuple[int, str | None, str]]]:
    tokens = [e for e in events if e.kind == EventKind.TOKEN]
    deltas = [(d.index, d.name, d.arguments) for e in tokens for d in decode_deltas(e.call_deltas)]
    return "".join(e.shown for e in tokens), "".join(e.text for e in tokens), deltas


def test_token_events_keep_the_text_and_show_the_content() -> None:
    events = run(PIECES)
    content, text, deltas = summary(events)
    assert content == "One moment.\n" and text == TEXT  # the raw text stays for a takeover
    done = events[-1]
    assert done.kind == EventKind.DONE and done.finish_reason == FinishReason.TOOL_CALLS
    calls = decode_calls(done.tool_calls)
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_time", '{"zone": "UTC"}'),
        ("add", '{"a": 1, "b": [2, 3]}'),
    ]
    names = [(i, n) for i, n, _ in deltas if n is not None]
    assert names == [(0, "get_time"), (1, "add")]
    for i, call in enumerate(calls):
        assert "".join(a for j, _, a in deltas if j == i) == call.arguments
    assert len(deltas) > 6  # fragments as they came, not a call at a time


def test_a_takeover_goes_on_with_the_same_calls() -> None:
    whole = summary(run(PIECES))
    for cut in range(1, len(PIECES)):
        rest = run(PIECES[cut:], before=PIECES[:cut])
        rest_content, _, rest_deltas = summary(rest)
        head = summary(run(PIECES[:cut])[:cut])  # the dead worker's events, not its finish
        assert head[0] + rest_content == whole[0], cut
        assert head[2] + rest_deltas == whole[2], cut
        assert decode_calls(rest[-1].tool_calls) == decode_calls(run(PIECES)[-1].tool_calls)


def test_text_held_as_a_maybe_call_comes_out_before_done() -> None:
    events = run(["I'd use <tool", "_call> tags."])
    # "<tool_call> tags." was held (maybe a call) and shown at the end, before done
    content, _, deltas = summary(events)
    assert content == "I'd use <tool_call> tags." and deltas == []
    assert events[-1].finish_reason == FinishReason.STOP and events[-1].tool_calls is None


def test_without_tools_events_are_as_before() -> None:
    a = Active("s1", None, "1-0", 30.0, 600.0)
    a.read_calls((), ToolFormat.HERMES)
    assert a.calls is None
    assert a.token_event("<tool_call>", with_ids=False) == ["k", "t", "x", "<tool_call>"]
