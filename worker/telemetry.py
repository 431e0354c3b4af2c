"""An engine worker's per-stream timings, latency histograms and summary lines.

The worker tells :class:`WorkerTelemetry` when it admits a request, when a
stream produces a token and when a stream's ``done`` event is confirmed in
Redis. From that it keeps the histograms published with the worker's stats
(core/wire/telemetry.py: queue wait, time to first token, time per output token,
inter-token latency, end-to-end latency; a relay's upstream time to first token) and
writes the stream's summary line, with the resume and disconnect counts gateways keep in
the stream's metadata.

With ``--otlp-endpoint`` (:attr:`WorkerTelemetry.tracing`, core/tracing.py) it also
records the stream's spans, children of the gateway's enqueue span whose traceparent
the request entry carries: ``worker.queue_wait`` (created -> admitted),
``worker.prefill`` (admitted -> first token), ``worker.decode`` (first -> last token,
one event every :data:`~core.tracing.TOKEN_EVENT_EVERY` token events) and
``worker.finish`` (last token -> the ``done`` event confirmed by Redis). Without it
a token costs one ``is None`` check more.

Times are measured from the stream's creation by its gateway (the ``ts`` field
of its metadata, epoch milliseconds), so queue wait and TTFT include the time
spent in the Redis request queue (clocks of gateway and worker machines are
assumed to be NTP-synchronised; a negative difference counts as zero).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenrelay.core.tracing import TOKEN_EVENT_EVERY, TraceParent, parse_traceparent
from tokenrelay.core.wire.events import F
from tokenrelay.core.wire.records import MetaField as M
from tokenrelay.core.wire.telemetry import Hist, as_int, log_summary, new_hists
from tokenrelay.core.wire.vocabulary import FinishReason

if TYPE_CHECKING:
    from tokenrelay.core.tracing import Span, Tracing
    from tokenrelay.worker.outbox import Active
    from tokenrelay.worker.store import WorkerStore

log = logging.getLogger("tokenrelay.worker")


@dataclass
class Timing:
    """Wall-clock times (epoch seconds) of one stream on this worker."""

    created: float  # the gateway created the stream
    admitted: float
    first_token: float | None = None
    last_token: float | None = None
    upstream_ttft: float | None = None  # a relay's: upstream request to its first token
    trace: StreamTrace | None = None  # with --otlp-endpoint


class StreamTrace:
    """The open spans of one stream on this worker (see the module doc)."""

    __slots__ = ("decode", "parent", "prefill", "tokens")

    def __init__(self, parent: TraceParent | str | None, prefill: Span) -> None:
        self.parent = parent
        self.prefill: Span | None = prefill
        self.decode: Span | None = None
        self.tokens = 0  # token events so far

    def token(self, tracing: Tracing, now: float) -> None:
        """One more token event at ``now``: the first ends the prefill, starts the decode."""
        self.tokens += 1
        ns = _ns(now)
        if self.decode is None:
            if self.prefill is not None:
                self.prefill.end(ns)
                self.prefill = None
            self.decode = tracing.start("worker.decode", self.parent, start_ns=ns)
        elif self.tokens % TOKEN_EVENT_EVERY == 0:
            self.decode.event("tokens", {"tokenrelay.token_events": self.tokens}, ns)

    def close(self, at: float | None, failure: str | None = None) -> None:
        """End the open spans (at ``at``, epoch s; ``failure``: marked failed)."""
        for span in (self.prefill, self.decode):
            if span is not None:
                if failure:
                    span.fail(failure)
                span.set({"tokenrelay.token_events": self.tokens})
                span.end(None if at is None else _ns(at))
        self.prefill = self.decode = None


def _ns(t: float) -> int:
    return int(t * 1e9)


def _created(meta: Mapping[str, str] | None, default: float) -> float:
    try:
        ms = float((meta or {}).get("ts") or "")
    except ValueError:
        return default
    return ms / 1000.0 if ms > 0 else default


class WorkerTelemetry:
    """Timings of the streams a worker runs, and its latency histograms."""

    def __init__(self, store: WorkerStore, worker_id: str, backend: str = "engine") -> None:
        self.store = store
        self.worker_id = worker_id
        self.backend = backend  # engine or upstream: in the summary lines
        self.hists: dict[str, Hist] = new_hists(backend)
        self.timings: dict[str, Timing] = {}
        self._json: dict[str, Any] | None = None
        self.tracing: Tracing | None = None  # --otlp-endpoint (set by worker/main.py)

    # --- events ------------------------------------------------------------------------

    def admitted(
        self, stream_id: str, meta: Mapping[str, str] | None, traceparent: str | None = None
    ) -> None:
        """A request was taken into the engine: records its queue wait (and, tracing,
        its queue-wait span under ``traceparent``, the request entry's)."""
        now = time.time()
        created = min(_created(meta, now), now)
        t = self.timings[stream_id] = Timing(created, now)
        self._observe("queue", now - created)
        if self.tracing is not None:
            t.trace = self._trace(self.tracing, stream_id, t, traceparent)

    @staticmethod
    def _trace(tracing: Tracing, stream_id: str, t: Timing, traceparent: str | None) -> StreamTrace:
        # None (a gateway without tracing, say): the queue wait starts a new trace, and
        # is the parent of the stream's other spans
        parent: TraceParent | str | None = parse_traceparent(traceparent)
        attrs = {"tokenrelay.stream_id": stream_id}
        queued = tracing.start(
            "worker.queue_wait", parent, start_ns=_ns(t.created), kind="consumer", attributes=attrs
        )
        queued.end(_ns(t.admitted))
        parent = parent or queued.traceparent
        prefill = tracing.start("worker.prefill", parent, start_ns=_ns(t.admitted))
        return StreamTrace(parent, prefill)

    def token(self, stream_id: str, upstream_ttft: float | None = None) -> None:
        """The stream produced a token in this step (a relay's first one: with the
        upstream's time to first token)."""
        t = self.timings.get(stream_id)
        if t is None:
            return
        if upstream_ttft is not None and t.upstream_ttft is None:
            t.upstream_ttft = upstream_ttft
            self._observe("upstream_ttft", upstream_ttft)
        now = time.time()
        if t.first_token is None:
            t.first_token = now
            self._observe("ttft", now - t.created)
        else:
            self._observe("itl", now - (t.last_token or now))
        t.last_token = now
        if t.trace is not None and self.tracing is not None:
            t.trace.token(self.tracing, now)

    def prune(self, keep: set[str]) -> None:
        """Drop the timings of streams not in ``keep`` (ended elsewhere, dropped)."""
        for sid in [s for s in self.timings if s not in keep]:
            t = self.timings.pop(sid)
            if t.trace is not None:
                t.trace.close(None, "stream dropped")

    def ended_foreign(
        self, stream_id: str, request_id: str | None, meta: Mapping[str, str]
    ) -> None:
        """Summary of a dead worker's stream this worker ended with ``error``."""
        log_summary(
            stream_id=stream_id,
            request_id=request_id,
            finish_reason=FinishReason.ERROR,
            prompt_tokens=as_int(meta.get(M.PROMPT_TOKENS)),
            completion_tokens=0,
            meta=meta,
            ended_by=self.worker_id,
        )

    def forget(self, stream_id: str) -> None:
        """Drop a stream with no summary (handed back to another worker)."""
        t = self.timings.pop(stream_id, None)
        if t is not None and t.trace is not None:
            t.trace.close(None, "handed back to the queue")

    def finished(self, streams: Iterable[Active]) -> None:
        """Streams whose ``done`` event Redis confirmed: histograms and summary lines."""
        done = [a for a in streams if a.events and a.events[-1][1] == "d"]
        if not done:
            return
        metas: list[dict[str, str]] = [{} for _ in done]
        with contextlib.suppress(Exception):  # the counts are best effort
            metas = self.store.stream_counts([a.stream_id for a in done])
        now = time.time()
        for a, meta in zip(done, metas, strict=True):
            ev = a.events[-1]
            fields = dict(zip(ev[0::2], ev[1::2], strict=False))
            completion = as_int(fields.get("n"))
            t = self.timings.pop(a.stream_id, None)
            ttft = tpot = e2e = queue = upstream_ttft = None
            if t is not None:
                upstream_ttft = t.upstream_ttft
                e2e = max(0.0, now - t.created)
                queue = max(0.0, t.admitted - t.created)
                if t.first_token is not None:
                    ttft = max(0.0, t.first_token - t.created)
                    if t.last_token is not None and completion > 1:
                        tpot = max(0.0, t.last_token - t.first_token) / (completion - 1)
                        self._observe("tpot", tpot)
                self._observe("e2e", e2e)
                if t.trace is not None and self.tracing is not None:
                    self._trace_finish(self.tracing, a, t, t.trace, fields, now)
            log_summary(
                stream_id=a.stream_id,
                request_id=a.request_id,
                finish_reason=fields.get(F.REASON, FinishReason.ERROR),
                prompt_tokens=as_int(fields.get(F.PROMPT_TOKENS)),
                completion_tokens=completion,
                meta=meta,
                ended_by=self.worker_id,
                ttft_s=ttft,
                tpot_s=tpot,
                e2e_s=e2e,
                queue_s=queue,
                backend=self.backend,
                upstream_ttft_s=upstream_ttft,
            )

    @staticmethod
    def _trace_finish(
        tracing: Tracing,
        a: Active,
        t: Timing,
        trace: StreamTrace,
        fields: dict[str, str],
        now: float,
    ) -> None:
        """End the stream's spans: decode at its last token, then ``worker.finish``."""
        ended = t.last_token or now
        trace.close(ended)
        finish = tracing.start(
            "worker.finish",
            trace.parent,
            start_ns=_ns(ended),
            attributes={
                "tokenrelay.stream_id": a.stream_id,
                "tokenrelay.finish_reason": fields.get(F.REASON, FinishReason.ERROR),
                "tokenrelay.prompt_tokens": as_int(fields.get(F.PROMPT_TOKENS)),
                "tokenrelay.completion_tokens": as_int(fields.get(F.COMPLETION_TOKENS)),
            },
        )
        finish.end(_ns(now))

    # --- publishing ----------------------------------------------------------------------

    def _observe(self, name: str, value: float) -> None:
        if name not in self.hists:
            return
        self.hists[name].observe(max(0.0, value))
        self._json = None

    def snapshot(self) -> dict[str, Any]:
        """The histograms as published in the worker's stats (``{"ttft": {...}, ...}``)."""
        if self._json is None:
            self._json = {name: h.to_json() for name, h in self.hists.items()}
        return self._json
