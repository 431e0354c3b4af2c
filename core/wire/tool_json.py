"""One tool-call object read as it streams: ``{"name": ..., "arguments": {...}}``.

Sans I/O. :class:`CallObject` is the state of the object core/wire/tool_stream.py is
reading; :meth:`CallObject.read` takes its next characters and tells the reader what
it found through the :class:`Sink` calls (a name, the arguments opening, a piece of
the arguments' JSON, the end). It follows the JSON's structure only as far as a call
needs (depth, strings and their escapes, the top-level keys); the arguments' text is
checked with ``json.loads`` once whole. Anything that is not a call object raises
:class:`NotACall`. A string is crossed in one jump to its next quote or backslash, so
every character is looked at a bounded number of times.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol

MAX_CALL_CHARS = 256 * 1024  # characters of one call object (and of a region's held text)
MAX_NAME_CHARS = 256  # a name (or key) string longer than this is no tool's
ARGUMENT_KEYS = ("arguments", "parameters")
_WS = " \t\r\n"
_STRING_STOP = re.compile(r'["\\]')


class NotACall(Exception):
    """The text being read is not (or no longer) a call; ``resume``: where reading goes
    on in the piece (None: after the character being read), the text up to it held."""

    def __init__(self, resume: int | None = None) -> None:
        super().__init__()
        self.resume = resume


class Sink(Protocol):
    """What the reader of a region hears from the object it reads."""

    def hold(self, run: str) -> None:
        """The object's text, past its first character."""

    def named(self, obj: CallObject, name: str | None) -> None:
        """The object's name string is read (None: not a valid JSON string)."""

    def open_call(self, obj: CallObject) -> None:
        """Its arguments start and its name is known: the call's first delta."""

    def args_text(self, obj: CallObject, run: str) -> None:
        """The next piece of its arguments' JSON text."""

    def object_done(self, obj: CallObject) -> None:
        """Its closing brace was read."""


@dataclass
class CallObject:
    """A call object being read (``bare``: the object is the arguments: ``name[ARGS]{``)."""

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
    args: list[str] = field(default_factory=list)  # the arguments' text so far
    args_done: bool = False
    scalar: bool = False  # a number/literal value at depth 1
    chars: int = 0
    index: int | None = None  # set once its first delta went out

    def read(self, text: str, i: int, sink: Sink, *, first: bool = False) -> int:
        """Read from ``text[i]`` on (one character, or a run inside a string); where
        reading goes on. ``first``: ``text[i]`` is the opening brace, held already."""
        c = text[i]
        if not first:
            sink.hold(c)
        self.chars += 1
        if self.chars > MAX_CALL_CHARS:
            raise NotACall
        if self.in_str:
            return self._string(text, i, sink)
        if self.bare:
            self._args(sink, c)
            return self._bare(c, i, sink)
        if self.depth == 0:  # the opening brace
            self.depth = 1
            return i + 1
        if self.depth > 1:
            if self.target == "args":
                self._args(sink, c)
            if self._nest(c) and self.depth == 1:
                self._value_done()
            return i + 1
        return self._top(c, i, sink)

    def _top(self, c: str, i: int, sink: Sink) -> int:
        """A character at depth 1."""
        if self.scalar:
            if c not in ",}" and c not in _WS:
                return i + 1
            self.scalar = False
            self.phase = "comma"
        if c in _WS:
            return i + 1
        phase = self.phase
        if phase == "key":
            if c == '"':
                self.in_str, self.key = True, []
                return i + 1
            if c == "}":
                sink.object_done(self)
                return i + 1
            raise NotACall
        if phase == "colon":
            if c != ":":
                raise NotACall
            self.phase = "value"
            return i + 1
        if phase == "value":
            return self._value(c, i, sink)
        if phase == "comma":
            if c == ",":
                self.phase = "key"
                return i + 1
            if c == "}":
                sink.object_done(self)
                return i + 1
        raise NotACall

    def _value(self, c: str, i: int, sink: Sink) -> int:
        """The first character of a top-level value."""
        key = self.key_done
        self.target = "name" if key == "name" else None
        if key in ARGUMENT_KEYS and not self.args_done:
            if c != "{":
                raise NotACall  # arguments must be an object
            self.target = "args"
            if self.name is not None:
                sink.open_call(self)
            self._args(sink, c)
        if self.target == "name" and c != '"':
            raise NotACall
        if c == '"':
            self.in_str = True
            if self.target == "name":
                self.name_buf = []
        elif c in "{[":
            self.depth += 1
        else:
            self.scalar = True
        return i + 1

    def _string(self, text: str, i: int, sink: Sink) -> int:
        """Inside a JSON string: jumps to the next quote or backslash."""
        c = text[i]
        if self.esc:
            self.esc = False
            self._string_run(c, sink)
            return i + 1
        if c == "\\":
            self.esc = True
            self._string_run(c, sink)
            return i + 1
        if c == '"':
            self.in_str = False
            self._string_run(c, sink, closing=True)
            return i + 1
        m = _STRING_STOP.search(text, i + 1)
        end = m.start() if m else len(text)
        rest = text[i + 1 : end]  # text[i] is held already
        if rest:
            sink.hold(rest)
            self.chars += len(rest)
            if self.chars > MAX_CALL_CHARS:
                raise NotACall(end)
        self._string_run(text[i:end], sink)
        return end

    def _string_run(self, run: str, sink: Sink, *, closing: bool = False) -> None:
        if self.bare or self.target == "args":
            self._args(sink, run)
            return
        if self.depth != 1:
            return
        if self.phase == "key":
            if closing:
                self.key_done = _decode_string(self.key)
                self.phase = "colon"
            else:
                self.key.append(run)
                if sum(map(len, self.key)) > MAX_NAME_CHARS:
                    self.key = self.key[:1]  # a long key is no key we read
            return
        if self.target == "name":
            if closing:
                self.target = None
                self.phase = "comma"
                sink.named(self, _decode_string(self.name_buf))
            else:
                self.name_buf.append(run)
                if sum(map(len, self.name_buf)) > MAX_NAME_CHARS:
                    raise NotACall
            return
        if closing:  # a skipped string value
            self.phase = "comma"

    def _bare(self, c: str, i: int, sink: Sink) -> int:
        if self._nest(c) and self.depth == 0:
            self.args_done = True
            sink.object_done(self)
        return i + 1

    def _nest(self, c: str) -> bool:
        """A character inside a value, outside strings; True when it closed a level."""
        if c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            return True
        return False

    def _args(self, sink: Sink, run: str) -> None:
        self.args.append(run)
        sink.args_text(self, run)

    def _value_done(self) -> None:
        if self.target == "args":
            self.args_done = True
        self.target = None
        self.phase = "comma"

    def arguments(self) -> str | None:
        """The whole arguments' text: ``{}`` when there were none, None when they were
        cut off or are not a JSON object."""
        if not self.args:
            return "{}"
        if not self.args_done:
            return None
        text = "".join(self.args)
        try:
            return text if isinstance(json.loads(text), dict) else None
        except (ValueError, RecursionError):
            return None


def _decode_string(parts: list[str]) -> str | None:
    """A JSON string's value from its raw inside (escapes included), None if broken."""
    try:
        value = json.loads('"' + "".join(parts) + '"')
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, str) else None
