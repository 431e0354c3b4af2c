"""core/tracing.py: the W3C traceparent (strict parse, format), the endpoint flag, the
spans' links through traceparents (an in-memory exporter), and no OpenTelemetry import
without ``--otlp-endpoint``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenrelay.core.tracing import (
    TOKEN_EVENT_EVERY,
    TraceParent,
    Tracing,
    check_endpoint,
    parse_traceparent,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{SPAN}-01"


def test_a_valid_traceparent_is_read() -> None:
    tp = parse_traceparent(VALID)
    assert tp == TraceParent(TRACE, SPAN, 1)
    assert tp.sampled and tp.format() == VALID
    assert parse_traceparent(f"00-{TRACE}-{SPAN}-00") == TraceParent(TRACE, SPAN, 0)
    assert parse_traceparent(f" {VALID}\t") == TraceParent(TRACE, SPAN, 1)  # header OWS


def test_a_later_version_is_read_by_its_first_four_fields() -> None:
    assert parse_traceparent(f"01-{TRACE}-{SPAN}-01") == TraceParent(TRACE, SPAN, 1)
    assert parse_traceparent(f"cc-{TRACE}-{SPAN}-01-what-comes-next") == TraceParent(TRACE, SPAN, 1)
    assert parse_traceparent(f"cc-{TRACE}-{SPAN}-01x") is None


@pytest.mark.parametrize(
    "value",
    [
        None,
        42,
        b"00-" + TRACE.encode() + b"-" + SPAN.encode() + b"-01",
        "",
        "garbage",
        VALID.upper(),  # hex is lowercase
        f"ff-{TRACE}-{SPAN}-01",  # version ff is invalid
        f"00-{TRACE}-{SPAN}-01-extra",  # version 00 is exactly 55 characters
        f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
        f"00-{TRACE[:-1]}-{SPAN}-01",
        f"00-{TRACE}-{SPAN}0-01",
        f"00-{TRACE}-{SPAN}-1",
        f"0-{TRACE}-{SPAN}-01",
        f"00_{TRACE}_{SPAN}_01",
        f"00-{TRACE}-{SPAN}-0g",
        "00-" + "x" * 600,
    ],
)
def test_a_malformed_traceparent_is_ignored(value: object) -> None:
    assert parse_traceparent(value) is None


def test_the_endpoint_flag() -> None:
    assert check_endpoint(None) is None and check_endpoint("  ") is None
    assert check_endpoint("http://localhost:4318") == "http://localhost:4318/v1/traces"
    assert check_endpoint("https://otel.example.com/") == "https://otel.example.com/v1/traces"
    assert check_endpoint("http://c:4318/custom/traces") == "http://c:4318/custom/traces"
    for bad in ("localhost:4318", "grpc://c:4317", "http://", "ftp://c/x"):
        with pytest.raises(ValueError, match="--otlp-endpoint"):
            check_endpoint(bad)


def test_opentelemetry_is_not_imported_without_the_flag() -> None:
    # (redis-py 7 imports OpenTelemetry's API and metrics SDK itself where they are
    # installed: redis/observability/providers.py. Our tracing SDK and exporter stay out.)
    code = (
        "import sys, tokenrelay.core.tracing, tokenrelay.gateway.server, tokenrelay.gateway.state, "
        "tokenrelay.gateway.streams.store, tokenrelay.worker.main, tokenrelay.worker.telemetry\n"
        "ours = ('opentelemetry.sdk.trace', 'opentelemetry.exporter')\n"
        "loaded = [m for m in sys.modules if m.startswith(ours)]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def memory_tracing(service: str = "test") -> tuple[Tracing, object]:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, service), exporter


def test_spans_link_through_traceparents() -> None:
    pytest.importorskip("opentelemetry.sdk")
    tracing, exporter = memory_tracing()
    root = tracing.start("a", VALID, kind="server", attributes={"k": 1, "none": None})
    child = tracing.start("b", root.traceparent, start_ns=1_000, attributes={"x": "y"})
    child.event("tokens", {"n": TOKEN_EVENT_EVERY}, at_ns=2_000)
    child.fail("boom")
    child.end(3_000)
    root.end()
    fresh = tracing.start("c", "not a traceparent")
    fresh.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}  # type: ignore[attr-defined]
    a, b, c = spans["a"], spans["b"], spans["c"]
    assert f"{a.context.trace_id:032x}" == TRACE and f"{a.parent.span_id:016x}" == SPAN
    assert a.parent.is_remote and dict(a.attributes) == {"k": 1}
    assert root.traceparent == f"00-{TRACE}-{a.context.span_id:016x}-01"
    assert b.context.trace_id == a.context.trace_id and b.parent.span_id == a.context.span_id
    assert (b.start_time, b.end_time) == (1_000, 3_000)
    assert [e.name for e in b.events] == ["tokens"] and b.events[0].timestamp == 2_000
    assert b.status.status_code.name == "ERROR"
    assert c.parent is None and c.context.trace_id != a.context.trace_id  # a new trace
    assert a.resource.attributes["service.name"] == "test"


def test_an_unsampled_parent_records_nothing() -> None:
    pytest.importorskip("opentelemetry.sdk")
    tracing, exporter = memory_tracing()
    span = tracing.start("quiet", f"00-{TRACE}-{SPAN}-00")
    assert span.traceparent.startswith(f"00-{TRACE}-") and span.traceparent.endswith("-00")
    span.end()
    assert exporter.get_finished_spans() == ()  # type: ignore[attr-defined]


def test_a_bad_endpoint_stops_the_gateway_settings() -> None:
    from tokenrelay.gateway.state import Settings

    with pytest.raises(ValueError, match="--otlp-endpoint"):
        Settings(redis_url="redis://localhost", otlp_endpoint="localhost:4318")
    assert Settings(redis_url="redis://localhost").otlp_endpoint is None


def test_the_flag_reads_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenrelay.core.cli import build_parser

    monkeypatch.setenv("TOKENRELAY_OTLP_ENDPOINT", "http://collector:4318")
    for command in ("serve", "gateway", "worker"):
        args = build_parser().parse_args([command, "--redis-url", "redis://x"])
        assert args.otlp_endpoint == "http://collector:4318", command


def test_the_edge_follows_links_or_ignores_a_clients_traceparent() -> None:
    from tokenrelay.core.tracing import ClientTrace, check_client_trace, edge_context

    tp = TraceParent(TRACE, SPAN, 1)
    assert edge_context(VALID, ClientTrace.FOLLOW) == (tp, ())
    assert edge_context(VALID, ClientTrace.LINK) == (None, (tp,))
    assert edge_context(VALID, ClientTrace.IGNORE) == (None, ())
    for policy in ClientTrace:
        assert edge_context("garbage", policy) == (None, ())
        assert edge_context(None, policy) == (None, ())
    assert check_client_trace("link") is ClientTrace.LINK
    with pytest.raises(ValueError, match="--client-traceparent must be one of follow, link"):
        check_client_trace("trust")


def test_a_linked_span_starts_a_trace_of_its_own() -> None:
    pytest.importorskip("opentelemetry.sdk")
    tracing, exporter = memory_tracing()
    span = tracing.start("edge", None, kind="server", links=[TraceParent(TRACE, SPAN, 0)])
    span.end()
    (got,) = exporter.get_finished_spans()  # type: ignore[attr-defined]
    assert got.parent is None and f"{got.context.trace_id:032x}" != TRACE
    assert got.context.trace_flags.sampled  # the client's unsampled flag decides nothing
    (link,) = got.links
    assert (f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") == (TRACE, SPAN)


def test_the_gateway_settings_check_the_client_traceparent_policy() -> None:
    from tokenrelay.core.cli import build_parser
    from tokenrelay.gateway.state import Settings

    assert Settings(redis_url="redis://localhost").client_traceparent == "link"
    with pytest.raises(ValueError, match="--client-traceparent"):
        Settings(redis_url="redis://localhost", client_traceparent="trust")
    for command in ("serve", "gateway"):
        args = build_parser().parse_args([command, "--redis-url", "redis://x"])
        assert args.client_traceparent == "link", command
        given = [command, "--redis-url", "redis://x", "--client-traceparent", "ignore"]
        assert Settings.from_args(build_parser().parse_args(given)).client_traceparent == "ignore"
