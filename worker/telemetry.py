"""An engine worker's per-stream timings, latency histograms and summary lines.

The worker tells :class:`WorkerTelemetry` when it admits a request, when a
stream produces a token and when a stream's ``done`` event is confirmed in
Redis. From that it keeps the histograms published with the worker's stats
(core/wire/telemetry.py: queue wait, time to first token, time per output token,
end-to-end latency; a relay's upstream time to first token) and writes the stream's
summary line, with the resume and disconnect counts gateways keep in the stream's
metadata.

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

from core.wire.telemetry import Hist, as_int, log_summary, new_hists

if TYPE_CHECKING:
    from worker.outbox import Active
    from worker.store import WorkerStore

log = logging.getLogger("tokenrelay.worker")


@dataclass
class Timing:
    """Wall-clock times (epoch seconds) of one stream on this worker."""

    created: float  # the gateway created the stream
    admitted: float
    first_token: float | None = None
    last_token: float | None = None
    upstream_ttft: float | None = None  # a relay's: upstream request to its first token


def _created(meta: Mapping[str, str] | None, default: float) -> float:
    try:
        ms = float((meta or {}).get("ts") or "")
    except ValueError:
        return default
    return ms / 1000.0 if ms > 0 else default


class WorkerTelemetry:
    """Timings of the streams a worker runs, and its latency histograms."""

    def __init__(self, wlog: WorkerStore, worker_id: str, backend: str = "engine") -> None:
        self.wlog = wlog
        self.worker_id = worker_id
        self.backend = backend  # engine or upstream: in the summary lines
        self.hists: dict[str, Hist] = new_hists(backend)
        self.timings: dict[str, Timing] = {}
        self._json: dict[str, Any] | None = None

    # --- events ------------------------------------------------------------------------

    def admitted(self, stream_id: str, meta: Mapping[str, str] | None) -> None:
        """A request was taken into the engine: records its queue wait."""
        now = time.time()
        created = min(_created(meta, now), now)
        self.timings[stream_id] = Timing(created, now)
        self._observe("queue", now - created)

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
        t.last_token = now

    def prune(self, keep: set[str]) -> None:
        """Drop the timings of streams not in ``keep`` (ended elsewhere, dropped)."""
        for sid in [s for s in self.timings if s not in keep]:
            del self.timings[sid]

    def ended_foreign(
        self, stream_id: str, request_id: str | None, meta: Mapping[str, str]
    ) -> None:
        """Summary of a dead worker's stream this worker ended with ``error``."""
        log_summary(
            stream_id=stream_id,
            request_id=request_id,
            finish_reason="error",
            prompt_tokens=as_int(meta.get("pt")),
            completion_tokens=0,
            meta=meta,
            ended_by=self.worker_id,
        )

    def forget(self, stream_id: str) -> None:
        """Drop a stream with no summary (handed back to another worker)."""
        self.timings.pop(stream_id, None)

    def finished(self, streams: Iterable[Active]) -> None:
        """Streams whose ``done`` event Redis confirmed: histograms and summary lines."""
        done = [a for a in streams if a.events and a.events[-1][1] == "d"]
        if not done:
            return
        metas: list[dict[str, str]] = [{} for _ in done]
        with contextlib.suppress(Exception):  # the counts are best effort
            metas = self.wlog.stream_counts([a.stream_id for a in done])
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
            log_summary(
                stream_id=a.stream_id,
                request_id=a.request_id,
                finish_reason=fields.get("r", "error"),
                prompt_tokens=as_int(fields.get("pt")),
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
