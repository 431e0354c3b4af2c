"""A generate request as a worker takes it from a request queue (worker/store.py).

The queue entry (a :class:`~tokenrelay.core.wire.records.QueuedRequest`) and the
stream's metadata hash become one :class:`Request`; fields that do not parse become
``None`` here, and the worker refuses such a request with a typed error (worker/intake.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenrelay.core.wire.records import QueuedRequest, as_text, text


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
    q = QueuedRequest.decode(fields)
    return Request(
        entry_id=text(eid),
        stream_id=q.stream_id,
        request_id=q.request_id,
        body=q.body,
        detach_timeout=q.detach_timeout,
        meta=as_text(meta) if meta else None,
        queue=queue,
        traceparent=q.traceparent,
    )
