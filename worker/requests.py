"""A generate request as a worker takes it from a request queue (worker/store.py).

The queue entry's fields (``sid``, ``rid``, ``body``, ``dt``, the trace context) and the
stream's metadata hash become one :class:`Request`; fields that do not parse become
``None`` here, and the worker refuses such a request with a typed error (worker/intake.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenrelay.core.wire.telemetry import TRACE_FIELD


def text(raw: Any) -> str:
    """A Redis reply's bytes (or anything) as text."""
    return raw.decode() if isinstance(raw, bytes) else str(raw)


@dataclass
class Request:
    """One generate request taken from the request stream."""

    entry_id: str
    stream_id: str
    request_id: str | None
    body: dict[str, Any] | None  # None when the entry is not valid JSON
    detach_timeout: float | None
    meta: dict[str, str] | None  # the stream's metadata (None: unknown or expired)
    queue: str | None = None  # the request queue it came from (None: ``P requests``)
    traceparent: str | None = None  # the gateway's enqueue span (--otlp-endpoint)


def entries_of(reply: Any) -> list[tuple[str, Any, Any]]:
    """``(queue, entry id, fields)`` of an ``XREADGROUP`` reply (several streams)."""
    return [(text(key), eid, fields) for key, es in (reply or []) for eid, fields in es]


def parse_request(queue: str | None, eid: Any, fields: Any, meta: Any) -> Request:
    """The :class:`Request` of one queue entry (raw fields) and its stream's metadata."""
    f = {text(k): text(v) for k, v in fields.items()}
    try:
        body = json.loads(f.get("body", ""))
        if not isinstance(body, dict):
            body = None
    except ValueError:
        body = None
    try:
        dt: float | None = float(f["dt"]) if f.get("dt") else None
    except ValueError:
        dt = None
    return Request(
        entry_id=text(eid),
        stream_id=f.get("sid", ""),
        request_id=f.get("rid") or None,
        body=body,
        detach_timeout=dt,
        meta={text(k): text(v) for k, v in meta.items()} if meta else None,
        queue=queue,
        traceparent=f.get(TRACE_FIELD),
    )
