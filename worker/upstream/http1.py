"""HTTP/1.1 as the relay speaks it, sans I/O: a request's bytes, a response parsed from bytes.

The relay's calls are long streaming responses read a few dozen bytes at a time
(one server-sent event per token), so the cost per read matters more than
anything else: :class:`ResponseParser` takes whatever bytes arrived and hands
back the status line and headers once, then the body's bytes with the framing
(``Transfer-Encoding: chunked``, ``Content-Length``, or until the connection
closes) taken off, in as few Python steps per read as it can. worker/upstream/client.py
feeds it from an asyncio protocol.

What it reads: ``HTTP/1.0`` and ``HTTP/1.1`` status lines, header fields (names
case-insensitive, at most :data:`MAX_HEAD` bytes of them), informational ``1xx``
answers skipped (at most :data:`MAX_INTERIM` of them), chunk extensions and trailers
read past. Each byte of a head is looked at once however the reads split it (a
scan offset, not a rescan of the buffer). What it refuses with
:class:`MalformedHttp`: anything else where a status line, a header or a chunk size
should be, a ``Content-Encoding`` (the relay asks for ``identity``), a transfer coding
other than ``chunked``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenrelay.worker.errors import MalformedHttp

MAX_HEAD = 65_536  # bytes of status line and headers
MAX_INTERIM = 10  # informational (1xx) answers before the real one
MAX_CHUNK_LINE = 4_096  # bytes of a chunk-size line (size and extensions)
NO_BODY_STATUSES = frozenset((204, 304))

# body framings
_CHUNKED, _LENGTH, _CLOSE, _NONE = "chunked", "length", "close", "none"
# chunked decoding states
_SIZE, _DATA, _DATA_END, _TRAILER = "size", "data", "data-end", "trailer"


@dataclass
class Head:
    """A response's status line and headers (names lower-cased; repeated ones joined)."""

    status: int
    reason: str
    headers: dict[str, str] = field(default_factory=dict)
    version: str = "HTTP/1.1"

    def get(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)


def request_bytes(method: str, target: str, host: str, headers: dict[str, str],
                  body: bytes = b"") -> bytes:  # fmt: skip
    """The bytes of one request (``Host`` and ``Content-Length`` added; keep-alive)."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"a header may not hold a line break: {name!r}")
        lines.append(f"{name}: {value}")
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class ResponseParser:
    """One response on a connection, from its first byte to the end of its body.

    :meth:`feed` the bytes as they arrive; :attr:`head` is set once the headers are
    in; :meth:`feed` returns the body bytes that arrived (framing removed);
    :attr:`done` says the body is complete. A body that lasts until the connection
    closes ends with :meth:`eof`. :attr:`reusable`: the connection may carry another
    request once this one is done (nothing beyond the body arrived, no ``close``).
    """

    def __init__(self, *, method: str = "GET") -> None:
        self.method = method
        self.head: Head | None = None
        self.done = False
        self.extra = False  # bytes arrived beyond the response's end
        self._buf = b""
        self._head = bytearray()  # the head's bytes so far
        self._scanned = 0  # bytes of _head searched for its end already
        self._interim = 0  # 1xx answers skipped
        self._framing = _NONE
        self._left = 0  # bytes left of the body (length) or of the chunk (chunked)
        self._state = _SIZE
        self._keep_alive = True

    @property
    def reusable(self) -> bool:
        return self.done and self._keep_alive and not self.extra

    def feed(self, data: bytes) -> bytes:
        """Take ``data``; the body bytes it completes (``b""`` when none)."""
        if self.done:
            self.extra = self.extra or bool(data)
            return b""
        if self.head is None:
            self._head += data
            if not self._read_head():
                return b""
            data = bytes(self._head)
            del self._head[:]
            if self.done:
                self.extra = bool(data)
                return b""
        if self._framing == _CHUNKED:
            return self._chunked(data)
        if self._framing == _LENGTH:
            if len(data) >= self._left:
                body, rest = data[: self._left], data[self._left :]
                self._left = 0
                self.done = True
                self.extra = bool(rest)
                return body
            self._left -= len(data)
            return data
        return data  # until the connection closes

    def eof(self) -> None:
        """The connection closed: the end of a body read until then, else an error."""
        if self.done:
            return
        if self.head is not None and self._framing == _CLOSE:
            self.done = True
            self._keep_alive = False
            return
        where = "the headers" if self.head is None else "the body"
        raise MalformedHttp(f"the connection closed before the end of {where}")

    # --- the head --------------------------------------------------------------------

    def _read_head(self) -> bool:
        """Parse the head if it is all in (skipping 1xx answers); False: wait for more.
        The head's bytes stay in ``_head``; what follows the head is left there."""
        buf = self._head
        while True:
            # a terminator may straddle the bytes already searched and the new ones
            end = buf.find(b"\r\n\r\n", max(0, self._scanned - 3))
            if end >= 0:
                raw, skip = bytes(buf[:end]), end + 4
            else:
                lf = buf.find(b"\n\n", max(0, self._scanned - 1))  # lines ended by LF alone
                if lf < 0:
                    self._scanned = len(buf)
                    if len(buf) > MAX_HEAD:
                        raise MalformedHttp(f"response headers over {MAX_HEAD} bytes")
                    return False
                raw, skip = bytes(buf[:lf]), lf + 2
            if len(raw) > MAX_HEAD:
                raise MalformedHttp(f"response headers over {MAX_HEAD} bytes")
            del buf[:skip]
            self._scanned = 0
            head = _parse_head(raw)
            if 100 <= head.status < 200 and head.status != 101:
                self._interim += 1  # 100 Continue, 103 Early Hints: the answer follows
                if self._interim > MAX_INTERIM:
                    raise MalformedHttp(f"over {MAX_INTERIM} informational (1xx) answers")
                continue
            self.head = head
            self._frame(head)
            return True

    def _frame(self, head: Head) -> None:
        connection = (head.get("connection") or "").lower()
        self._keep_alive = head.version == "HTTP/1.1" and "close" not in connection
        encoding = (head.get("content-encoding") or "identity").strip().lower()
        if encoding != "identity":
            raise MalformedHttp(f"unexpected Content-Encoding: {encoding}")
        if self.method == "HEAD" or head.status in NO_BODY_STATUSES:
            self._framing = _NONE
            self.done = True
            return
        coding = head.get("transfer-encoding")
        if coding is not None:
            codings = [c.strip().lower() for c in coding.split(",") if c.strip()]
            if codings != ["chunked"]:
                raise MalformedHttp(f"unsupported Transfer-Encoding: {coding}")
            self._framing, self._state = _CHUNKED, _SIZE
            return
        length = head.get("content-length")
        if length is not None:
            values = {v.strip() for v in length.split(",")}
            if len(values) != 1 or not next(iter(values)).isdigit():
                raise MalformedHttp(f"bad Content-Length: {length}")
            self._framing, self._left = _LENGTH, int(next(iter(values)))
            if self._left == 0:
                self.done = True
            return
        self._framing = _CLOSE
        self._keep_alive = False

    # --- chunked bodies ----------------------------------------------------------------

    def _chunked(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        self._buf = b""
        out: list[bytes] = []
        pos, n = 0, len(buf)
        while pos < n:
            state = self._state
            if state == _DATA:
                take = min(self._left, n - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = _DATA_END
                continue
            eol = buf.find(b"\n", pos)
            if eol < 0:
                if n - pos > MAX_CHUNK_LINE:
                    raise MalformedHttp("a chunk-size line is too long")
                self._buf = buf[pos:]
                break
            line = buf[pos:eol].rstrip(b"\r")
            pos = eol + 1
            if state == _SIZE:
                size = line.split(b";", 1)[0].strip()
                try:
                    self._left = int(size, 16)
                except ValueError:
                    raise MalformedHttp(f"bad chunk size: {line[:40]!r}") from None
                if self._left < 0:
                    raise MalformedHttp(f"bad chunk size: {line[:40]!r}")
                self._state = _DATA if self._left else _TRAILER
            elif state == _DATA_END:
                if line:
                    raise MalformedHttp("a chunk's data is longer than its size")
                self._state = _SIZE
            elif not line:  # _TRAILER: a blank line ends the body
                self.done = True
                self.extra = pos < n
                break
        return b"".join(out) if len(out) != 1 else out[0]


def _parse_head(raw: bytes) -> Head:
    lines = raw.decode("latin-1").replace("\r\n", "\n").split("\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise MalformedHttp(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        name = name.strip().lower()
        if not sep or not name or " " in name:
            raise MalformedHttp(f"bad header line: {line[:80]!r}")
        value = value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return Head(int(code), reason.strip(), headers, version)
