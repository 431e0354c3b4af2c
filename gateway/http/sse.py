"""Server-sent events, sans I/O: encode events and comments, parse a byte stream.

The gateway writes events with :func:`encode_event` (one ``id:`` line, an
optional ``event:`` line and one ``data:`` line per line of the payload) and
keeps idle connections open with :data:`KEEPALIVE` comment lines. :class:`SSEParser`
is the matching incremental decoder (WHATWG rules: ``\\n``, ``\\r\\n`` or
``\\r`` line ends, comments ignored, ``id`` remembered across events), used by
the tests and the benchmark; browsers use ``EventSource``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DONE",
    "KEEPALIVE",
    "SSEEvent",
    "SSEParser",
    "comment",
    "encode_event",
    "parse_event_id",
]

# A comment line alone, with no blank line after it: a blank line would end an
# (empty) event, which some clients (the OpenAI SDKs, once an ``id`` was seen)
# dispatch as an event with empty data and then fail to parse.
KEEPALIVE = b": keep-alive\n"
DONE = b"data: [DONE]\n\n"
MAX_EVENT_ID = 2**53  # ids are stream offsets; anything larger is not one of ours


def encode_event(data: str, *, id: int | str | None = None, event: str | None = None) -> bytes:
    """One SSE event: ``id:``/``event:`` lines, then ``data:`` per line of ``data``."""
    out: list[str] = []
    if id is not None:
        sid = str(id)
        if any(c in sid for c in "\r\n\0"):
            raise ValueError("an event id must not contain CR, LF or NUL")
        out.append(f"id: {sid}\n")
    if event is not None:
        if any(c in event for c in "\r\n"):
            raise ValueError("an event name must not contain CR or LF")
        out.append(f"event: {event}\n")
    for line in data.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        out.append(f"data: {line}\n")
    out.append("\n")
    return "".join(out).encode("utf-8")


def comment(text: str = "") -> bytes:
    """Comment lines (ignored by clients; they keep proxies from timing out).

    No blank line follows: see :data:`KEEPALIVE`.
    """
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return "".join(f": {line}\n" if line else ":\n" for line in lines).encode()


def parse_event_id(raw: str | None) -> int | None:
    """The stream offset in a ``Last-Event-ID`` header or ``after`` parameter.

    ``None`` or blank gives ``None``; anything but a (possibly negative)
    decimal integer raises ``ValueError``.
    """
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    body = text[1:] if text.startswith("-") else text
    if not body.isascii() or not body.isdigit() or len(body) > 16:
        raise ValueError(f"not a stream offset: {raw[:40]!r}")
    value = int(text)
    if abs(value) >= MAX_EVENT_ID:
        raise ValueError(f"not a stream offset: {raw[:40]!r}")
    return value


@dataclass(frozen=True)
class SSEEvent:
    """One dispatched event (``id`` is the last id seen, as in ``EventSource``)."""

    data: str
    event: str = "message"
    id: str | None = None


class SSEParser:
    """Incremental SSE decoder: :meth:`feed` bytes, get the completed events."""

    def __init__(self) -> None:
        self._buf = ""
        self._pending = b""
        self._data: list[str] = []
        self._event = ""
        self._has_data = False
        self.last_id: str | None = None
        self.comments = 0

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Decode ``chunk`` (any split, even inside a UTF-8 character)."""
        raw = self._pending + chunk
        try:
            text = raw.decode("utf-8")
            self._pending = b""
        except UnicodeDecodeError as exc:
            if exc.start < len(raw) - 3:
                raise
            text, self._pending = raw[: exc.start].decode("utf-8"), raw[exc.start :]
        self._buf += text
        events: list[SSEEvent] = []
        while True:
            idx = min(
                (i for i in (self._buf.find("\n"), self._buf.find("\r")) if i >= 0), default=-1
            )
            if idx < 0:
                return events
            if self._buf[idx] == "\r" and idx == len(self._buf) - 1:
                return events  # a lone CR at the end may be half of CRLF
            line = self._buf[:idx]
            skip = 2 if self._buf.startswith("\r\n", idx) else 1
            self._buf = self._buf[idx + skip :]
            ev = self._line(line)
            if ev is not None:
                events.append(ev)

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            if not self._has_data:
                self._event = ""
                return None
            ev = SSEEvent("\n".join(self._data), self._event or "message", self.last_id)
            self._data, self._event, self._has_data = [], "", False
            return ev
        if line.startswith(":"):
            self.comments += 1
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
            self._has_data = True
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self.last_id = value
        return None
