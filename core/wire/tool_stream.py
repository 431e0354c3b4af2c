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

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenrelay.core.wire.tool_formats import SYNTAX, ToolFormat

MAX_CALL_CHARS = 256 * 1024  # characters of one call object (and of a region's held text)
MAX_CALLS = 128  # calls read from one completion, at most
MAX_NAME_CHARS = 256  # a name string longer than this is no tool's
_WS = " \t\r\n"
_STRING_STOP = re.compile(r'["\\]')

__all__ = ["MAX_CALLS", "MAX_CALL_CHARS", "CallDelta", "CallStream", "Split"]


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


class _Fail(Exception):
    """The region being read is not (or no longer) calls."""


@dataclass
class _Object:
    """One call object being read (``bare``: the object is the arguments: ``name[ARGS]``)."""

    bare: bool = False
    name: str | None = None
    depth: int = 0
    in_str: bool = False
    esc: bool = False
    phase: str = "key"  # at depth 1: key, colon, value, comma
    key: list[str] = field(default_factory=list)
    key_done: str | None = None
    target: str | None = None  # the value being read: "name", "args", or None (skipped)
    name_buf: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    args_done: bool = False
    scalar: bool = False  # a number/literal value at depth 1
    chars: int = 0
    index: int | None = None  # set once its first delta went out


class CallStream:
    """Splits a completion into content and call deltas (see the module docstring)."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[Any], stream_id: str) -> None:
        from tokenrelay.core.wire.tools import ToolCall, call_id  # tools.py imports us

        self._ToolCall, self._call_id = ToolCall, call_id
        self.syntax = SYNTAX[fmt]
        self.offered = {t.name for t in tools}
        self.stream_id = stream_id
        self.calls: list[Any] = []  # ToolCall: the calls read whole
        self._next_index = 0
        self._mode = "text"
        self._pending = ""  # text mode: a possible marker (or leading whitespace) held back
        self._at_start = self.syntax.leading_object  # nothing but whitespace shown yet
        self._after_call = False  # text mode: whitespace after a call is dropped
        self._region: list[str] | None = None  # the region's text, while no delta went out
        self._region_chars = 0
        self._obj: _Object | None = None
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
            except _Fail:
                self._fail()
                i += 1
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

    def _hold(self, c: str) -> None:
        if self._region is not None:
            self._region.append(c)
            self._region_chars += 1
            if self._region_chars > MAX_CALL_CHARS:
                raise _Fail

    def _region_char(self, text: str, i: int, c: str) -> int:
        mode = self._mode
        if mode == "object":
            return self._object(text, i)
        self._hold(c)
        s = self.syntax
        if mode in ("start", "opened", "next"):
            if c in _WS:
                return i + 1
            if c == "{":
                self._obj = _Object()
                self._mode = "object"
                return self._object(text, i, first=True)
            if c == "[" and s.array and mode == "opened":
                self._mode = "next"
                return i + 1
            if s.named_args and mode == "opened" and (c.isalnum() or c in "_-"):
                self._mode, self._name = "name", [c]
                return i + 1
            raise _Fail
        if mode == "name":  # mistral: name[ARGS]{...}
            if not self._match and (c.isalnum() or c in "_-"):
                if len(self._name) >= MAX_NAME_CHARS:
                    raise _Fail
                self._name.append(c)
                return i + 1
            return self._marker(c, s.named_args or "", "bare", i)
        if mode == "bare":
            if c in _WS:
                return i + 1
            if c != "{":
                raise _Fail
            self._obj = _Object(bare=True)
            self._named("".join(self._name))
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
                self._obj = _Object()
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
            raise _Fail
        if self._match == marker:
            self._match = ""
            if then == "closed":
                self._end_region()
            else:
                self._mode = then
        return i + 1

    # --- one call object --------------------------------------------------------------

    def _object(self, text: str, i: int, *, first: bool = False) -> int:
        """Reads object characters from ``i`` on (one, or a run inside a string)."""
        obj = self._obj
        assert obj is not None
        c = text[i]
        if not first:
            self._hold(c)
        obj.chars += 1
        if obj.chars > MAX_CALL_CHARS:
            raise _Fail
        if obj.in_str:
            return self._string(text, i, obj)
        if obj.bare:
            self._args_text(obj, c)
            return self._bare(obj, c, i)
        if obj.depth == 0:  # the opening brace
            obj.depth = 1
            return i + 1
        if obj.depth > 1:
            if obj.target == "args":
                self._args_text(obj, c)
            if c == '"':
                obj.in_str = True
            elif c in "{[":
                obj.depth += 1
            elif c in "}]":
                obj.depth -= 1
                if obj.depth == 1:
                    self._value_done(obj)
            return i + 1
        return self._top(obj, c, i)

    def _top(self, obj: _Object, c: str, i: int) -> int:
        """A character at depth 1 of a call object."""
        if obj.scalar:
            if c in ",}" or c in _WS:
                obj.scalar = False
                obj.phase = "comma"
            else:
                return i + 1
        if c in _WS:
            return i + 1
        phase = obj.phase
        if phase == "key":
            if c == '"':
                obj.in_str, obj.key = True, []
                return i + 1
            if c == "}":
                return self._object_done(obj, i)
            raise _Fail
        if phase == "colon":
            if c != ":":
                raise _Fail
            obj.phase = "value"
            return i + 1
        if phase == "value":
            key = obj.key_done
            obj.target = "name" if key == "name" else None
            if key in ("arguments", "parameters") and not obj.args_done:
                if c != "{":
                    raise _Fail  # arguments must be an object
                obj.target = "args"
                if obj.name is not None:
                    self._open_call(obj)
                self._args_text(obj, c)
            if obj.target == "name" and c != '"':
                raise _Fail
            if c == '"':
                obj.in_str = True
                if obj.target == "name":
                    obj.name_buf = []
            elif c in "{[":
                obj.depth += 1
            else:
                obj.scalar = True
            return i + 1
        if phase == "comma":
            if c == ",":
                obj.phase = "key"
                return i + 1
            if c == "}":
                return self._object_done(obj, i)
        raise _Fail

    def _string(self, text: str, i: int, obj: _Object) -> int:
        """Inside a JSON string: jumps to the next quote or backslash."""
        c = text[i]
        if obj.esc:
            obj.esc = False
            self._string_chars(obj, c)
            return i + 1
        if c == "\\":
            obj.esc = True
            self._string_chars(obj, c)
            return i + 1
        if c == '"':
            obj.in_str = False
            self._string_chars(obj, c, closing=True)
            return i + 1
        m = _STRING_STOP.search(text, i + 1)
        end = m.start() if m else len(text)
        rest = text[i + 1 : end]  # text[i] is held already; the rest is held here
        if obj.chars + len(rest) > MAX_CALL_CHARS or (
            self._region is not None and self._region_chars + len(rest) > MAX_CALL_CHARS
        ):
            raise _Fail
        if rest:
            obj.chars += len(rest)
            if self._region is not None:
                self._region.append(rest)
                self._region_chars += len(rest)
        self._string_chars(obj, text[i:end])
        return end

    def _string_chars(self, obj: _Object, run: str, *, closing: bool = False) -> None:
        if obj.bare or obj.target == "args":
            self._args_text(obj, run)
            return
        if obj.depth != 1:
            return
        if obj.phase == "key":
            if closing:
                obj.key_done = _decode_string(obj.key)
                obj.phase = "colon"
            else:
                obj.key.append(run)
                if sum(map(len, obj.key)) > MAX_NAME_CHARS:
                    obj.key = obj.key[:1]  # a long key is no key we read
            return
        if obj.target == "name":
            if closing:
                obj.target = None
                obj.phase = "comma"
                self._named(_decode_string(obj.name_buf))
            else:
                obj.name_buf.append(run)
                if sum(map(len, obj.name_buf)) > MAX_NAME_CHARS:
                    raise _Fail
            return
        if closing:  # a skipped string value
            obj.phase = "comma"

    def _bare(self, obj: _Object, c: str, i: int) -> int:
        if c == '"':
            obj.in_str = True
        elif c in "{[":
            obj.depth += 1
        elif c in "}]":
            obj.depth -= 1
            if obj.depth == 0:
                obj.args_done = True
                return self._object_done(obj, i)
        return i + 1

    def _args_text(self, obj: _Object, run: str) -> None:
        obj.args.append(run)
        if obj.index is not None:
            self._frag.setdefault(obj.index, []).append(run)

    def _value_done(self, obj: _Object) -> None:
        if obj.target == "args":
            obj.args_done = True
        obj.target = None
        obj.phase = "comma"

    def _named(self, name: str | None) -> None:
        """The call's name is read: an offered tool's, or the region is no call."""
        obj = self._obj
        assert obj is not None
        if name is None or name not in self.offered or obj.name is not None:
            raise _Fail
        obj.name = name
        if obj.args or obj.bare:  # its arguments came first (or come next: name[ARGS]{)
            self._open_call(obj)

    def _open_call(self, obj: _Object) -> None:
        """The call's first delta goes out (with the arguments read so far): from here on
        the region is calls, never shown."""
        assert obj.name is not None
        obj.index = self._next_index
        self._next_index += 1
        self._region = None
        self._out.deltas.append(CallDelta(obj.index, obj.name, ""))
        if obj.args:
            self._frag[obj.index] = list(obj.args)

    def _object_done(self, obj: _Object, i: int) -> int:
        if obj.name is None:
            raise _Fail
        if obj.index is None:  # no arguments: {} (opened once they are known to be fine)
            if obj.args:
                raise _Fail
            self._open_call(obj)
        assert obj.index is not None
        args = "".join(obj.args) if obj.args_done else ""
        if not obj.args:
            args = "{}"
            self._frag.setdefault(obj.index, []).append(args)
        elif not obj.args_done:
            raise _Fail
        try:
            ok = isinstance(json.loads(args), dict)
        except (ValueError, RecursionError):
            ok = False
        if not ok:
            raise _Fail
        self.calls.append(self._ToolCall(self._call_id(self.stream_id, obj.index), obj.name, args))
        self._obj = None
        self._mode = "after"
        return i + 1

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


def _decode_string(parts: list[str]) -> str | None:
    """A JSON string's value from its raw inside (escapes included), None if broken."""
    try:
        value = json.loads('"' + "".join(parts) + '"')
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, str) else None
