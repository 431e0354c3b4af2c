"""A worker's spans of one stream (queue wait, prefill, decode with token events, finish)
and its inter-token latency histogram, with an in-memory span exporter."""

from __future__ import annotations

from typing import Any

import pytest

from tests.core.test_tracing import SPAN, TRACE, VALID, memory_tracing
from tokenrelay.core.tracing import TOKEN_EVENT_EVERY
from tokenrelay.core.wire.events import accepted_fields, done_fields, token_fields
from tokenrelay.worker.outbox import Active
from tokenrelay.worker.telemetry import WorkerTelemetry


class NoCounts:
    def stream_counts(self, ids: list[str]) -> list[dict[str, str]]:
        raise ConnectionError("no redis here")


def run_stream(telemetry: WorkerTelemetry, tokens: int, traceparent: str | None) -> None:
    telemetry.admitted("s1", {"ts": "1"}, traceparent)
    for _ in range(tokens):
        telemetry.token("s1")
    a = Active("s1", "r1", "0-1", 30.0, 60.0)
    a.events = [accepted_fields(3, "w"), *[token_fields("x")] * tokens,
                done_fields("length", 3, tokens)]  # fmt: skip
    telemetry.finished([a])


def test_inter_token_latency_is_one_observation_per_gap() -> None:
    telemetry = WorkerTelemetry(NoCounts(), "w")  # type: ignore[arg-type]
    run_stream(telemetry, 5, None)
    assert telemetry.hists["itl"].count == 4
    assert telemetry.snapshot()["itl"]["cum"][-1] == 4
    assert telemetry.hists["ttft"].count == 1


def test_the_spans_of_one_stream() -> None:
    pytest.importorskip("opentelemetry.sdk")
    tracing, exporter = memory_tracing("tokenrelay-worker")
    telemetry = WorkerTelemetry(NoCounts(), "w")  # type: ignore[arg-type]
    telemetry.tracing = tracing
    tokens = 2 * TOKEN_EVENT_EVERY + 1
    run_stream(telemetry, tokens, VALID)
    spans: dict[str, Any] = {s.name: s for s in exporter.get_finished_spans()}  # type: ignore[attr-defined]
    names = ["worker.queue_wait", "worker.prefill", "worker.decode", "worker.finish"]
    assert sorted(spans) == sorted(names)
    for name in names:
        assert f"{spans[name].context.trace_id:032x}" == TRACE, name
        assert f"{spans[name].parent.span_id:016x}" == SPAN, name
    wait, prefill = spans["worker.queue_wait"], spans["worker.prefill"]
    decode, finish = spans["worker.decode"], spans["worker.finish"]
    assert wait.end_time == prefill.start_time and prefill.end_time == decode.start_time
    assert decode.end_time == finish.start_time <= finish.end_time
    assert [e.attributes["tokenrelay.token_events"] for e in decode.events] == [
        TOKEN_EVENT_EVERY,
        2 * TOKEN_EVENT_EVERY,
    ]
    assert decode.attributes["tokenrelay.token_events"] == tokens
    assert finish.attributes["tokenrelay.finish_reason"] == "length"
    assert finish.attributes["tokenrelay.completion_tokens"] == tokens
    assert not telemetry.timings


def test_a_handed_back_stream_ends_its_spans() -> None:
    pytest.importorskip("opentelemetry.sdk")
    tracing, exporter = memory_tracing()
    telemetry = WorkerTelemetry(NoCounts(), "w")  # type: ignore[arg-type]
    telemetry.tracing = tracing
    telemetry.admitted("s1", None, "not one")  # a bad traceparent: a new trace
    telemetry.forget("s1")
    spans = {s.name: s for s in exporter.get_finished_spans()}  # type: ignore[attr-defined]
    assert spans["worker.prefill"].status.status_code.name == "ERROR"
    wait, prefill = spans["worker.queue_wait"], spans["worker.prefill"]
    assert wait.parent is None  # the root of a new trace, the parent of the others
    assert prefill.parent.span_id == wait.context.span_id
    assert prefill.context.trace_id == wait.context.trace_id
