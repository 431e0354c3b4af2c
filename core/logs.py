"""Structured logging: one JSON object per line (or a readable text form).

Every ``extra={...}`` field passed to a log call becomes a key of the JSON
line, so correlation ids (``request_id``, ``stream_id``) travel with the
message instead of being formatted into it.

Some of those values come from clients. JSON lines escape them by construction;
the text form escapes them with :func:`escape` (control characters, line and
paragraph separators, bidirectional overrides and backslashes), so no value can
start a forged line or drive the terminal, and quotes a value holding spaces.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from typing import Any

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


# C0 and C1 controls, DEL, line/paragraph separators, bidi marks and overrides, backslash
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\\]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _escaped(match: re.Match[str]) -> str:
    c = match.group()
    return _SHORT.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def escape(text: str) -> str:
    """``text`` on one line, nothing a terminal acts on: ``a\\nb`` for a newline, ``\\x1b``..."""
    return _UNSAFE.sub(_escaped, text)


def _value(value: Any) -> str:
    """One ``key=value`` value for the text form: escaped, quoted when it holds spaces."""
    text = escape(str(value))
    if not text or any(c.isspace() or c in '"=' for c in text):
        return '"' + text.replace('"', '\\"') + '"'
    return text


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _RESERVED and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """``{"ts":…, "level":…, "logger":…, "msg":…, <extras>}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_extras(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``HH:MM:SS level logger: msg key=value ...`` for a terminal, one line per record.

    The message and the values are escaped (:func:`escape`); a traceback follows
    on its own lines, as Python prints it.
    """

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        extras = " ".join(f"{escape(k)}={_value(v)}" for k, v in _extras(record).items())
        message = escape(record.getMessage())
        line = f"{stamp} {record.levelname.lower():7s} {record.name}: {message}"
        if extras:
            line += "  " + extras
        if record.exc_info:  # its own lines, each escaped
            trace = self.formatException(record.exc_info)
            line += "\n" + "\n".join(escape(part) for part in trace.split("\n"))
        return line


def setup_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Configure the root logger once for a tokenrelay process.

    ``fmt`` is ``json`` or ``text`` (default: ``$TOKENRELAY_LOG_FORMAT``, else
    text on a terminal and JSON otherwise).
    """
    level = (level or os.environ.get("TOKENRELAY_LOG_LEVEL") or "info").upper()
    fmt = (
        fmt
        or os.environ.get("TOKENRELAY_LOG_FORMAT")
        or ("text" if sys.stderr.isatty() else "json")
    )
    if fmt not in ("json", "text"):
        raise ValueError(f"log format must be 'json' or 'text', got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "urllib3", "filelock", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
