"""Tool calls read from a completion as it is generated: content, and call deltas.

Sans I/O and torch-free. :class:`CallStream` takes the completion's text piece by piece
(:meth:`CallStream.feed`) and splits each piece into the content to show now and
:class:`CallDelta` s: a call's first delta names it (``name``), the following ones carry
fragments of its ``arguments``, the JSON text exactly as the model writes it, as soon as
it is written. The worker stores both with the piece's token event (core/wire/events.py:
``v`` and ``d``), so every surface streams them and a resume replays them.

The rules, for every format (core/wire/tool_formats.py):

* text before a call region is content; a partial marker at the end of a piece waits for
  the next one; whitespace between and after calls is dropped;
* a call object's ``name`` must be an offered tool: its first delta goes out once the
  name is read and its ``arguments`` start as an object, then the arguments as they
  come (arguments read before the name go out with it); a call without arguments gets
  ``{}``;
* a region that turns out not to be calls (not JSON, an unknown tool, a marker inside
  prose) before any delta went out is content after all: its text is shown then;
* a call whose object breaks off after its first delta (cut by ``max_tokens``, JSON
  that does not parse, over :data:`MAX_CALL_CHARS`) is left out of :attr:`calls` (the
  done event's list); its index is not used again.

Every character is looked at a bounded number of times (no backtracking, no rescans);
a call object is at most :data:`MAX_CALL_CHARS` characters, a region's held text too, and
at most :data:`MAX_CALLS` calls are read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenrelay.core.wire.tool_formats import SYNTAX, ToolFormat
from tokenrelay.core.wire.tool_json import MAX_CALL_CHARS, MAX_NAME_CHARS, CallObject, NotACall

MAX_CALLS = 128  # calls read from one completion, at most
_WS = " \t\r\n"

__all__ = ["MAX_CALLS", "MAX_CALL_CHARS", "CallDelta", "CallStream", "Split", "ToolCall", "call_id"]


@dataclass(frozen=True)
class CallDelta:
    """A piece of call ``index``: its ``name`` on the first delta, then ``arguments``
    fragments (JSON text, possibly ``""``)."""

    index: int
    name: str | None
    arguments: str


@dataclass
class Split:
    """What one piece of text gives: ``content`` to show and the call ``deltas``."""

    content: str = ""
    deltas: list[CallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: ``arguments`` is JSON text (OpenAI sends it as a string)."""

    id: str
    name: str
    arguments: str

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {} if index is None else {"index": index}
        fn = {"name": self.name, "arguments": self.arguments}
        return {**out, "id": self.id, "type": "function", "function": fn}


def call_id(stream_id: str, index: int) -> str:
    """A call's id: stable for the stream, so a resumed or re-read answer shows the same."""
    digest = hashlib.sha256(f"{stream_id}:{index}".encode()).hexdigest()
    return "call_" + digest[:24]


class CallStream:
    """Splits a completion into content and call deltas (see the module docstring)."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[Any], stream_id: str) -> None:
        self.syntax = SYNTAX[fmt]
        self.offered = {t.name for t in tools}
        self.stream_id = stream_id
        self.calls: list[ToolCall] = []  # the calls read whole
        self._next_index = 0
        self._mode = "text"
        self._pending = ""  # text mode: a possible marker (or leading whitespace) held back
        self._at_start = self.syntax.leading_object  # nothing but whitespace shown yet
        self._after_call = False  # text mode: whitespace after a call is dropped
        self._region: list[str] | None = None  # the region's text, while no delta went out
        self._region_chars = 0
        self._obj: CallObject | None = None
        self._match = ""  # a marker being matched (closer, [ARGS])
        self._name: list[str] = []  # mistral's name[ARGS]
        self._out = Split()
        self._frag: dict[int, list[str]] = {}

    @property
    def streamed(self) -> bool:
        """Whether a call delta went out."""
        return self._next_index > 0

    # --- the public steps -----------------------------------------------------------

    def feed(self, text: str) -> Split:
        """The content and deltas of the next piece of the completion."""
        self._out = Split()
        i = 0
        while i < len(text):
            if self._mode == "text":
                i = self._text(text, i)
                continue
            c = text[i]
            try:
                i = self._region_char(text, i, c)
            except NotACall as stop:  # the text up to ``resume`` is held: shown, or dropped
                self._fail()
                i = i + 1 if stop.resume is None else stop.resume
        return self._flush()

    def finish(self) -> Split:
        """What is left at the end: held text that was no call, and the last deltas."""
        self._out = Split()
        if self._mode == "text":
            if not self._after_call:
                self._show(self._pending)
            self._pending = ""
        else:
            self._fail()
            self._show(self._pending)
            self._pending = ""
        return self._flush()

    # --- text -----------------------------------------------------------------------

    def _text(self, text: str, i: int) -> int:
        """Show text up to the next marker; returns where reading goes on in ``text``."""
        held = len(self._pending)  # buf's first ``held`` characters are not in text[i:]
        buf = self._pending + text[i:]
        self._pending = ""
        pos = 0
        if self._after_call or self._at_start:
            pos = len(buf) - len(buf.lstrip(_WS))
            if pos == len(buf):  # only whitespace so far: hold (start) or drop (after calls)
                self._pending = buf if self._at_start else ""
                return len(text)
            if self._at_start and buf[pos] == "{":
                self._at_start = False
                self._begin(buf[:pos], "start")
                return i + pos - held  # the region is read from its "{"
            if self._at_start:
                self._show(buf[:pos])
            self._at_start = self._after_call = False
        rest = buf[pos:]
        at, marker = self._find_marker(rest)
        if at >= 0:
            self._show(rest[:at])
            self._begin(marker, "opened")
            return i + pos + at + len(marker) - held
        keep = self._partial_marker(rest)
        self._show(rest[: len(rest) - keep])
        self._pending = rest[len(rest) - keep :]
        return len(text)

    def _find_marker(self, buf: str) -> tuple[int, str]:
        best, found = -1, ""
        for m in self.syntax.openers:
            at = buf.find(m)
            if at >= 0 and (best < 0 or at < best):
                best, found = at, m
        return best, found

    def _partial_marker(self, buf: str) -> int:
        for keep in range(min(max(len(m) for m in self.syntax.openers) - 1, len(buf)), 0, -1):
            tail = buf[-keep:]
            if any(m.startswith(tail) for m in self.syntax.openers):
                return keep
        return 0

    def _show(self, text: str) -> None:
        if text:
            self._out.content += text
            self._at_start = False

    # --- regions --------------------------------------------------------------------

    def _begin(self, held: str, mode: str) -> None:
        if self._next_index >= MAX_CALLS:
            self._show(held)  # no more calls are read: it stays text
            return
        self._mode = mode
        self._region, self._region_chars = [held], len(held)

    def _fail(self) -> None:
        """The region is no calls (from here on): shown if nothing of it went out."""
        obj = self._obj
        if obj is not None and obj.index is not None:
            self._frag.pop(obj.index, None)
        if self._region is not None:
            self._show("".join(self._region))
        self._region, self._obj, self._match, self._name = None, None, "", []
        self._mode = "text"

    def _end_region(self) -> None:
        self._region, self._obj, self._match, self._name = None, None, "", []
        self._mode, self._after_call = "text", True

    def _region_char(self, text: str, i: int, c: str) -> int:
        mode = self._mode
        if mode == "object":
            return self._object(text, i)
        self.hold(c)
        if self._region_chars > MAX_CALL_CHARS:
            raise NotACall
        s = self.syntax
        if mode in ("start", "opened", "next"):
            if c in _WS:
                return i + 1
            if c == "{":
                self._obj = CallObject()
                self._mode = "object"
                return self._object(text, i, first=True)
            if c == "[" and s.array and mode == "opened":
                self._mode = "next"
                return i + 1
            if s.named_args and mode == "opened" and (c.isalnum() or c in "_-"):
                self._mode, self._name = "name", [c]
                return i + 1
            raise NotACall
        if mode == "name":  # mistral: name[ARGS]{...}
            if not self._match and (c.isalnum() or c in "_-"):
                if len(self._name) >= MAX_NAME_CHARS:
                    raise NotACall
                self._name.append(c)
                return i + 1
            return self._marker(c, s.named_args or "", "bare", i)
        if mode == "bare":
            if c in _WS:
                return i + 1
            if c != "{":
                raise NotACall
            self._obj = CallObject(bare=True)
            self.named(self._obj, "".join(self._name))
            self._mode = "object"
            return self._object(text, i, first=True)
        if mode == "after":  # after a call object
            if c in _WS:
                return i + 1
            if s.closer is not None:
                return self._marker(c, s.closer, "closed", i)
            if s.array and c == ",":
                self._mode = "next"
                return i + 1
            if s.array and c == "]":
                self._end_region()
                return i + 1
            if c in s.separators:
                self._mode = "start"
                return i + 1
            if s.leading_object and c == "{":
                self._obj = CallObject()
                self._mode = "object"
                return self._object(text, i, first=True)
            self._end_region()  # llama3: text after the calls
            return i
        raise AssertionError(mode)

    def _marker(self, c: str, marker: str, then: str, i: int) -> int:
        """One more character of ``marker``; once whole, ``then`` is the mode (or the
        region ends, for Hermes' closer)."""
        self._match += c
        if not marker.startswith(self._match):
            raise NotACall
        if self._match == marker:
            self._match = ""
            if then == "closed":
                self._end_region()
            else:
                self._mode = then
        return i + 1

    # --- one call object (core/wire/tool_json.py reads it, these hear from it) ----------

    def _object(self, text: str, i: int, *, first: bool = False) -> int:
        obj = self._obj
        assert obj is not None
        return obj.read(text, i, self, first=first)

    def hold(self, run: str) -> None:
        """Text of the region, kept to be shown should it be no call, while no delta of
        it went out (the region's own cap is checked a character at a time; an object
        has its own, core/wire/tool_json.py)."""
        if self._region is not None:
            self._region.append(run)
            self._region_chars += len(run)

    def args_text(self, obj: CallObject, run: str) -> None:
        """A piece of the arguments' JSON: a fragment once the call is open."""
        if obj.index is not None:
            self._frag.setdefault(obj.index, []).append(run)

    def named(self, obj: CallObject, name: str | None) -> None:
        """The call's name is read: an offered tool's, or the region is no call."""
        if name is None or name not in self.offered or obj.name is not None:
            raise NotACall
        obj.name = name
        if obj.args or obj.bare:  # its arguments came first (or come next: name[ARGS]{)
            self.open_call(obj)

    def open_call(self, obj: CallObject) -> None:
        """The call's first delta goes out (with the arguments read so far): from here on
        the region is calls, never shown."""
        assert obj.name is not None
        obj.index = self._next_index
        self._next_index += 1
        self._region = None
        self._out.deltas.append(CallDelta(obj.index, obj.name, ""))
        if obj.args:
            self._frag[obj.index] = list(obj.args)

    def object_done(self, obj: CallObject) -> None:
        """The call object ended: a call if it is whole and its arguments are JSON."""
        if obj.name is None:
            raise NotACall
        if obj.index is None:  # no arguments: {} (opened once they are known to be fine)
            if obj.args:
                raise NotACall
            self.open_call(obj)
        assert obj.index is not None
        args = obj.arguments()
        if args is None:
            raise NotACall
        if not obj.args:
            self._frag.setdefault(obj.index, []).append(args)
        self.calls.append(ToolCall(call_id(self.stream_id, obj.index), obj.name, args))
        self._obj = None
        self._mode = "after"

    def _flush(self) -> Split:
        out = self._out
        named = {d.index for d in out.deltas}
        merged: list[CallDelta] = []
        for d in out.deltas:
            frag = "".join(self._frag.pop(d.index, []))
            merged.append(CallDelta(d.index, d.name, frag))
        for index, parts in self._frag.items():
            if index not in named and parts:
                merged.append(CallDelta(index, None, "".join(parts)))
        self._frag = {}
        out.deltas = sorted(merged, key=lambda d: d.index)
        return out
