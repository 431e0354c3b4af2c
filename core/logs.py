"""Structured logging: one JSON object per line (or a readable text form).

Every ``extra={...}`` field passed to a log call becomes a key of the JSON
line, so correlation ids (``request_id``, ``stream_id``) travel with the
message instead of being formatted into it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


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
    """``HH:MM:SS level logger: msg key=value ...`` for a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        extras = " ".join(f"{k}={v}" for k, v in _extras(record).items())
        line = f"{stamp} {record.levelname.lower():7s} {record.name}: {record.getMessage()}"
        if extras:
            line += "  " + extras
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
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
