"""What gateways and workers write for each other in Redis, as typed records (sans I/O).

A gateway queues a :class:`QueuedRequest` on a request queue and writes the new
stream's metadata hash ``P m:{id}`` (:meth:`StreamMeta.new_fields`); workers read both,
write the stream's progress into the same hash (status, worker, prompt tokens) and the
events into its log (core/wire/events.py). The field names of both live here once
(:class:`RequestField`, :class:`MetaField`), so a rename on one side is a rename on both.
Decoding is lenient: a field that does not parse becomes ``None``, and the reader
refuses the request with a typed error instead of failing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenrelay.core.wire.telemetry import DISCONNECTS_FIELD, RESUMES_FIELD, TRACE_FIELD
from tokenrelay.core.wire.vocabulary import StreamStatus


class RequestField:
    """The fields of a request-queue entry."""

    STREAM_ID = "sid"
    REQUEST_ID = "rid"
    BODY = "body"  # the worker request body, JSON: messages or prompt, params, model
    DETACH_TIMEOUT = "dt"  # seconds a detached stream keeps generating
    STREAM_TTL = "ttl"  # seconds the stream is kept after its end
    TRACE = TRACE_FIELD  # the gateway's enqueue span (--otlp-endpoint)


class MetaField:
    """The fields of a stream's metadata hash ``P m:{id}``."""

    TOKEN_HASH = "tok"  # the resume token's hash (the hash exists iff the stream does)
    STATUS = "st"  # a StreamStatus
    REQUEST_ID = "rid"
    CREATED_MS = "ts"
    GATEWAY = "gw"  # the gateway that created it
    STREAM_TTL = "ttl"
    WORKER = "w"  # the worker that accepted it
    PROMPT_TOKENS = "pt"
    FINISH_REASON = "fr"  # set with the done event (the append script)
    LAST_SEQ = "last"  # likewise
    CANCEL = "cx"  # "1": a cancel was asked for
    TAKEOVERS = "to"  # how many times a live worker took the stream from a dead one
    LOG_OWNER = "lo"  # whose ledger counts the log's bytes (core/wire/log_ledger.py)
    TRACE = TRACE_FIELD  # the stream's receive span
    RESUMES = RESUMES_FIELD
    DISCONNECTS = DISCONNECTS_FIELD


def text(raw: Any) -> str:
    """A Redis reply's bytes (or anything) as text."""
    return raw.decode("utf-8", "surrogatepass") if isinstance(raw, bytes) else str(raw)


def as_text(fields: Mapping[Any, Any] | None) -> dict[str, str]:
    """A hash or stream entry from Redis (bytes or str) as ``str -> str``."""
    return {text(k): text(v) for k, v in (fields or {}).items()}


def _float(raw: str | None) -> float | None:
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


@dataclass(frozen=True)
class QueuedRequest:
    """One generate request on a request queue."""

    stream_id: str
    request_id: str | None
    body: dict[str, Any] | None  # None when the entry's body is not a JSON object
    detach_timeout: float | None
    stream_ttl: float | None = None
    traceparent: str | None = None

    def encode(self) -> dict[str, str]:
        """The entry's fields, for ``XADD``."""
        out = {
            RequestField.STREAM_ID: self.stream_id,
            RequestField.REQUEST_ID: self.request_id or "",
            RequestField.BODY: json.dumps(self.body, ensure_ascii=False),
        }
        if self.detach_timeout is not None:
            out[RequestField.DETACH_TIMEOUT] = str(self.detach_timeout)
        if self.stream_ttl is not None:
            out[RequestField.STREAM_TTL] = str(self.stream_ttl)
        if self.traceparent is not None:
            out[RequestField.TRACE] = self.traceparent
        return out

    @classmethod
    def decode(cls, fields: Mapping[Any, Any]) -> QueuedRequest:
        """The request of one entry (bytes or str fields); never raises."""
        f = as_text(fields)
        try:
            body = json.loads(f.get(RequestField.BODY, ""))
        except ValueError:
            body = None
        return cls(
            stream_id=f.get(RequestField.STREAM_ID, ""),
            request_id=f.get(RequestField.REQUEST_ID) or None,
            body=body if isinstance(body, dict) else None,
            detach_timeout=_float(f.get(RequestField.DETACH_TIMEOUT)),
            stream_ttl=_float(f.get(RequestField.STREAM_TTL)),
            traceparent=f.get(RequestField.TRACE),
        )


@dataclass(frozen=True)
class StreamMeta:
    """A stream's metadata hash, decoded (what a gateway checks before it serves it)."""

    stream_id: str
    status: StreamStatus
    request_id: str | None
    worker: str | None
    prompt_tokens: int
    finish_reason: str | None
    last_seq: int | None
    cancel_requested: bool
    token_hash: str
    stream_ttl: float

    @staticmethod
    def new_fields(
        token_hash: str,
        request_id: str | None,
        created_ms: int,
        gateway: str,
        stream_ttl: float,
        traceparent: str | None = None,
    ) -> dict[str, str]:
        """The hash of a stream just created, for ``HSET``: ``queued``, no worker yet."""
        out = {
            MetaField.TOKEN_HASH: token_hash,
            MetaField.STATUS: StreamStatus.QUEUED,
            MetaField.REQUEST_ID: request_id or "",
            MetaField.CREATED_MS: str(created_ms),
            MetaField.GATEWAY: gateway,
            MetaField.STREAM_TTL: str(stream_ttl),
        }
        if traceparent is not None:
            out[MetaField.TRACE] = traceparent
        return out

    @classmethod
    def decode(
        cls, stream_id: str, fields: Mapping[Any, Any], default_ttl: float
    ) -> StreamMeta | None:
        """The metadata of ``stream_id`` from its hash; None when there is none."""
        f = as_text(fields)
        if MetaField.TOKEN_HASH not in f:
            return None
        try:
            status = StreamStatus(f.get(MetaField.STATUS, StreamStatus.QUEUED))
        except ValueError:
            status = StreamStatus.QUEUED
        last = f.get(MetaField.LAST_SEQ)
        return cls(
            stream_id=stream_id,
            status=status,
            request_id=f.get(MetaField.REQUEST_ID) or None,
            worker=f.get(MetaField.WORKER) or None,
            prompt_tokens=int(f.get(MetaField.PROMPT_TOKENS) or 0),
            finish_reason=f.get(MetaField.FINISH_REASON) or None,
            last_seq=int(last) if last else None,
            cancel_requested=f.get(MetaField.CANCEL) == "1",
            token_hash=f[MetaField.TOKEN_HASH],
            stream_ttl=_float(f.get(MetaField.STREAM_TTL)) or default_ttl,
        )
