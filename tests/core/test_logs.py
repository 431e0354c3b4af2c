"""core/logs.py: client-supplied values cannot forge lines or drive a terminal (issue 19)."""

from __future__ import annotations

import json
import logging
import sys

from tokenrelay.core.logs import JsonFormatter, TextFormatter, escape


def record(msg: str = "resume", *args: object, **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("tokenrelay.ws", logging.INFO, __file__, 1, msg, args or None, None)
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def test_text_logs_escape_client_ids() -> None:
    forged = "r1\n10:00:00 error   tokenrelay.ws: forged\x1b[2J\r\u2028\u202e"
    line = TextFormatter().format(record(request_id=forged, stream_id="abc"))
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert "\u2028" not in line and "\u202e" not in line
    assert "request_id=" in line and "\\n10:00:00" in line and "\\x1b[2J" in line
    assert "\\u2028\\u202e" in line and line.endswith("stream_id=abc")


def test_text_logs_escape_the_message_and_quote_spaced_values() -> None:
    line = TextFormatter().format(record("frame %s", "a\nb", reason='say "hi"', empty=""))
    assert "frame a\\nb" in line
    assert 'reason="say \\"hi\\""' in line and 'empty=""' in line


def test_escape_is_unambiguous() -> None:
    assert escape("a\\nb") == "a\\\\nb" and escape("a\nb") == "a\\nb"
    assert escape("tab\there") == "tab\\there" and escape("\x00\x7f\x9b") == "\\x00\\x7f\\x9b"
    assert escape("caf\u00e9 \u2603 ok") == "caf\u00e9 \u2603 ok"  # printable text stays


def test_tracebacks_stay_on_their_own_lines_escaped() -> None:
    try:
        raise ValueError("bad id r1\x1b[31m")
    except ValueError:
        rec = logging.LogRecord("t", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    text = TextFormatter().format(rec)
    assert text.count("\n") >= 2 and "\x1b" not in text and "\\x1b[31m" in text


def test_json_logs_keep_the_value() -> None:
    forged = "r1\n\x1b[2J"
    line = JsonFormatter().format(record(request_id=forged))
    assert "\n" not in line and "\x1b" not in line
    assert json.loads(line)["request_id"] == forged
