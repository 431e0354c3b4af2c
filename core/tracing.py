"""W3C trace context, and the optional OpenTelemetry tracing of requests (``--otlp-endpoint``).

Two halves:

- sans I/O: :func:`parse_traceparent` checks a client's ``traceparent`` strictly (W3C
  Trace Context, level 1: ``00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>``,
  lowercase, ids not all zero; a later version's longer value is read by its first four
  fields), and :class:`TraceParent` formats one. A malformed value is ignored (the
  request starts a new trace), never refused. :func:`check_endpoint` validates the flag.
  :func:`edge_context` decides what a client's value becomes at the gateway, by
  ``--client-traceparent`` (:class:`ClientTrace`): the parent of the request's spans
  (``follow``), a link from a new trace (``link``, the default: a client can neither put
  its spans into a trace of its choosing nor decide whether they are sampled), or
  nothing (``ignore``).
- :func:`start_tracing` builds a :class:`Tracing`: an OpenTelemetry ``TracerProvider``
  of its own (never the global one) whose spans leave in batches through OTLP over HTTP
  (protobuf) on a thread of the SDK's. OpenTelemetry is imported there and nowhere else:
  without ``--otlp-endpoint`` nothing of it loads, and the code that would trace holds a
  ``None`` :class:`Tracing` and pays one ``is None`` check.

Spans are linked by traceparent strings, the form in which a context travels anyway
(the Redis request entry, the stream's metadata): :meth:`Tracing.start` takes the
parent as one, and :attr:`Span.traceparent` gives a span's own. docs/operations.md
("Tracing") lists the spans of a request.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("tokenrelay.tracing")

HEADER = "traceparent"  # the HTTP header, WebSocket field and gRPC metadata key
GATEWAY_SERVICE = "tokenrelay-gateway"  # the resource attribute service.name of each side
WORKER_SERVICE = "tokenrelay-worker"
TOKEN_EVENT_EVERY = 32  # the decode span has one event per this many token events
EXPORT_DELAY_MS = 1000  # the batch exporter's interval (the SDK's default is 5 s)
TRACES_PATH = "/v1/traces"
MAX_LENGTH = 512  # longer values are not looked at

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


@dataclass(frozen=True)
class TraceParent:
    """A parsed ``traceparent``: the trace id, the parent span id and the trace flags."""

    trace_id: str  # 32 lowercase hex digits, not all zero
    span_id: str  # 16 lowercase hex digits, not all zero
    flags: int = 1  # bit 0: sampled

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)

    def format(self) -> str:
        """The version-00 header value."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags:02x}"


def parse_traceparent(value: object) -> TraceParent | None:
    """The trace context ``value`` holds, or ``None`` (logged at debug) when it is not a
    valid W3C ``traceparent``: wrong type or length, upper-case hex, version ``ff``, a
    version-00 value with anything after the flags, an all-zero trace or parent id."""
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_LENGTH:
        log.debug("ignoring a traceparent that is not a short string")
        return None
    text = value.strip(" \t")
    m = _TRACEPARENT.fullmatch(text)
    if m is None:
        return _bad(text)
    version, trace_id, span_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return _bad(text)
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return _bad(text)
    return TraceParent(trace_id, span_id, int(flags, 16))


class ClientTrace(StrEnum):
    """What the gateway makes of a client's ``traceparent`` (``--client-traceparent``)."""

    FOLLOW = "follow"  # the parent of the request's spans: the client's trace goes on
    LINK = "link"  # a new trace, its first span linked to the client's
    IGNORE = "ignore"  # a new trace; the client's value is not looked at


DEFAULT_CLIENT_TRACE = ClientTrace.LINK


def check_client_trace(value: object) -> ClientTrace:
    """``--client-traceparent`` as a :class:`ClientTrace`; ``ValueError`` for anything else."""
    if isinstance(value, str) and value in ClientTrace.__members__.values():
        return ClientTrace(value)
    names = ", ".join(c.value for c in ClientTrace)
    raise ValueError(f"--client-traceparent must be one of {names}, got {value!r}")


def edge_context(
    value: object, policy: ClientTrace
) -> tuple[TraceParent | None, tuple[TraceParent, ...]]:
    """The parent and the links of the first span of a client's request, from the
    ``traceparent`` it sent (``value``, unchecked) and ``policy``."""
    if policy is ClientTrace.IGNORE:
        return None, ()
    tp = parse_traceparent(value)
    if tp is None:
        return None, ()
    return (tp, ()) if policy is ClientTrace.FOLLOW else (None, (tp,))


def _bad(text: str) -> TraceParent | None:
    """Logs ``text`` as ignored; always ``None``."""
    log.debug("ignoring a malformed traceparent", extra={"traceparent": text[:80]})
    return None


def check_endpoint(endpoint: str | None) -> str | None:
    """The OTLP/HTTP traces URL of ``--otlp-endpoint`` (``None``: tracing off).

    ``http(s)://host:port`` gets OTLP's ``/v1/traces`` path; a URL with a path is used
    as given. Raises ``ValueError`` for anything else.
    """
    if endpoint is None or not endpoint.strip():
        return None
    url = endpoint.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"--otlp-endpoint must be an http:// or https:// URL of an OTLP/HTTP "
            f"collector (e.g. http://localhost:4318), not {endpoint!r}"
        )
    if parts.path in ("", "/"):
        url = url.rstrip("/") + TRACES_PATH
    return url


class Span:
    """One OpenTelemetry span, with the few calls the gateway and worker make."""

    __slots__ = ("_span", "traceparent")

    def __init__(self, span: Any) -> None:
        self._span = span
        ctx = span.get_span_context()
        self.traceparent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def set(self, attributes: dict[str, Any]) -> None:
        """Set attributes (``None`` values are left out)."""
        self._span.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def event(
        self, name: str, attributes: dict[str, Any] | None = None, at_ns: int | None = None
    ) -> None:
        """Add an event (at ``at_ns``, epoch nanoseconds; default now)."""
        self._span.add_event(name, attributes or {}, timestamp=at_ns)

    def fail(self, message: str) -> None:
        """Mark the span as failed."""
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, message[:200]))

    def end(self, at_ns: int | None = None) -> None:
        """End the span (at ``at_ns``, epoch nanoseconds; default now)."""
        self._span.end(end_time=at_ns)


class Tracing:
    """The tracer of one process (gateway or worker); build it with :func:`start_tracing`."""

    def __init__(self, provider: Any, service: str) -> None:
        from opentelemetry import context, trace

        self._provider = provider
        self._trace = trace
        self._empty = context.Context()
        self._tracer = provider.get_tracer("tokenrelay")
        self.service = service

    def start(
        self,
        name: str,
        parent: str | TraceParent | None,
        *,
        start_ns: int | None = None,
        kind: str = "internal",
        attributes: dict[str, Any] | None = None,
        links: Sequence[TraceParent] = (),
    ) -> Span:
        """Start a span, child of ``parent`` (a traceparent: already checked, or a client's,
        checked here; ``None`` or an invalid one: the root of a new trace), linked to
        ``links``. ``kind``: ``internal``, ``server``, ``consumer`` or ``producer``."""
        tp = parent if isinstance(parent, TraceParent) else parse_traceparent(parent)
        t = self._trace
        ctx = self._empty
        if tp is not None:
            ctx = t.set_span_in_context(t.NonRecordingSpan(self._remote(tp)), ctx)
        span = self._tracer.start_span(
            name,
            context=ctx,
            kind=getattr(t.SpanKind, kind.upper()),
            attributes={k: v for k, v in (attributes or {}).items() if v is not None},
            links=[t.Link(self._remote(link)) for link in links],
            start_time=start_ns,
        )
        return Span(span)

    def _remote(self, tp: TraceParent) -> Any:
        """The OpenTelemetry ``SpanContext`` of another process's span."""
        t = self._trace
        return t.SpanContext(
            int(tp.trace_id, 16),
            int(tp.span_id, 16),
            is_remote=True,
            trace_flags=t.TraceFlags(tp.flags & 0xFF),
        )

    def flush(self, timeout_s: float = 5.0) -> None:
        """Export the spans ended so far."""
        self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Export what is left and stop the exporter's thread."""
        try:
            self._provider.shutdown()
        except Exception:  # never fail a shutdown over traces
            log.warning("tracing shutdown failed", exc_info=True)


def start_tracing(endpoint: str, service: str, instance: str | None = None) -> Tracing:
    """A :class:`Tracing` exporting to ``endpoint`` (see :func:`check_endpoint`) as
    ``service`` (resource attribute ``service.name``; ``instance``: its
    ``service.instance.id``). Raises ``ValueError`` when the endpoint is not a URL or
    OpenTelemetry is not installed (``pip install 'tokenrelay[tracing]'``)."""
    url = check_endpoint(endpoint)
    if url is None:
        raise ValueError("--otlp-endpoint is empty")
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ValueError(
            f"--otlp-endpoint needs OpenTelemetry ({exc.name} is missing): "
            "pip install 'tokenrelay[tracing]'"
        ) from None
    from tokenrelay.core.runtime import version

    attributes = {"service.name": service, "service.version": version()}
    if instance:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attributes))
    exporter = OTLPSpanExporter(endpoint=url, timeout=10)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
    log.info("tracing on", extra={"otlp_endpoint": url, "service": service})
    return Tracing(provider, service)
