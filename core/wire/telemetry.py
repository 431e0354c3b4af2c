"""Per-stream telemetry shared by engine workers and gateways.

- :class:`Hist`: a latency histogram with fixed buckets that travels as JSON.
  Engine workers record time to first token, time per output token, inter-token
  latency (the gap between consecutive token events of a stream), end-to-end
  latency and queue wait in them (relay workers also the upstream's own
  time to first token, from sending the upstream request to its first token) and
  publish the cumulative bucket counts with their stats snapshot (``P w:<worker_id>``
  field ``stats``, key ``hist``); gateways sum the histograms of the live workers for ``/metrics``
  (gateway/observe/metrics.py). Each gateway keeps one more of its own,
  :data:`DELIVERY_BUCKETS`: from a worker's append (Redis' clock, carried by the live
  feed's message) to the live event's handing to the client's socket.
- The stream summary: exactly one ``stream summary`` log line per finished
  stream, written by whoever wrote its ``done`` event (the engine worker, or a
  gateway that ended the stream itself). Gateways count the stream's resumes
  and disconnects into its metadata hash (fields ``rs`` with :data:`COUNT_LUA`,
  ``dc`` with core/wire/scripts.py's ``DETACH_LUA``), so the line has them whichever
  gateways served it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

RESUMES_FIELD = "rs"  # resumes of the stream, counted by gateways in its meta hash
DISCONNECTS_FIELD = "dc"  # clients that left the stream before its end
# a traceparent (core/tracing.py), with --otlp-endpoint: in the stream's meta hash the
# gateway's receive span (resumes join its trace), in the request entry the enqueue span
TRACE_FIELD = "tp"

# The histograms a worker publishes: name -> bucket upper bounds (seconds).
BUCKETS: dict[str, tuple[float, ...]] = {
    "ttft": (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    "tpot": (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    "itl": (0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    "e2e": (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0),
    "queue": (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    "upstream_ttft": (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
}
RELAY_ONLY = ("upstream_ttft",)  # histograms only relay workers keep
# a gateway's delivery latency: worker append -> socket (Redis' clock is in ms)
DELIVERY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


summary_log = logging.getLogger("tokenrelay.summary")


class Hist:
    """Counts of observations per bucket (``le`` upper bounds), their sum and count."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket; the last one is +Inf
        self.sum = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> None:
        """Record one observation (negative or non-finite values are ignored)."""
        if not math.isfinite(value) or value < 0:
            return
        i = 0
        while i < len(self.bounds) and value > self.bounds[i]:
            i += 1
        self.counts[i] += 1
        self.sum += value

    def cumulative(self) -> list[int]:
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out

    def to_json(self) -> dict[str, Any]:
        """``{"le": [...], "cum": [... one more for +Inf], "sum": s}``."""
        return {"le": list(self.bounds), "cum": self.cumulative(), "sum": round(self.sum, 6)}

    @classmethod
    def from_json(cls, raw: object) -> Hist | None:
        """The histogram ``raw`` describes, or None when it is malformed."""
        if not isinstance(raw, Mapping):
            return None
        le, cum, total = raw.get("le"), raw.get("cum"), raw.get("sum")
        if not isinstance(le, list) or not isinstance(cum, list) or len(cum) != len(le) + 1:
            return None
        try:
            bounds = [float(b) for b in le]
            counts = [int(c) for c in cum]
            hsum = float(total) if total is not None else 0.0
        except (TypeError, ValueError):
            return None
        if bounds != sorted(bounds) or any(b > a for a, b in zip(counts[1:], counts, strict=False)):
            return None
        h = cls(bounds)
        prev = 0
        for i, c in enumerate(counts):
            h.counts[i] = c - prev
            prev = c
        h.sum = hsum
        return h

    def add(self, other: Hist) -> bool:
        """Add ``other``'s counts (same buckets only); False when they differ."""
        if other.bounds != self.bounds:
            return False
        for i, c in enumerate(other.counts):
            self.counts[i] += c
        self.sum += other.sum
        return True

    def prometheus_buckets(self) -> list[tuple[str, float]]:
        """``[(le, cumulative count), ..., ("+Inf", count)]`` for a histogram family."""
        cum = self.cumulative()
        out = [(_le(b), float(c)) for b, c in zip(self.bounds, cum, strict=False)]
        out.append(("+Inf", float(cum[-1])))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


def new_hists(backend: str = "engine") -> dict[str, Hist]:
    """One empty :class:`Hist` per entry of :data:`BUCKETS` that a worker of ``backend``
    keeps (:data:`RELAY_ONLY` ones for ``upstream`` only)."""
    return {
        name: Hist(bounds)
        for name, bounds in BUCKETS.items()
        if backend == "upstream" or name not in RELAY_ONLY
    }


def as_int(value: object) -> int:
    """``value`` as an int (0 when it is not one: Redis fields may hold anything)."""
    try:
        return int(value)  # type: ignore[call-overload,no-any-return]
    except (TypeError, ValueError):
        return 0


def log_summary(
    *,
    stream_id: str,
    request_id: str | None,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    meta: Mapping[str, Any] | None = None,
    ended_by: str,
    ttft_s: float | None = None,
    tpot_s: float | None = None,
    e2e_s: float | None = None,
    queue_s: float | None = None,
    backend: str | None = None,
    upstream_ttft_s: float | None = None,
) -> None:
    """Write the one ``stream summary`` line of a finished stream.

    ``meta`` is the stream's metadata hash (its resume and disconnect counts);
    ``ended_by`` names the worker or gateway that wrote the ``done`` event;
    ``backend`` what produced it (``engine``, ``upstream``; ``None`` from a gateway);
    ``upstream_ttft_s`` a relay's time from its upstream request to the first token.
    """
    meta = meta or {}

    def rounded(v: float | None) -> float | None:
        return None if v is None else round(v, 4)

    extra = {
        "request_id": request_id,
        "stream_id": stream_id,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "ttft_s": rounded(ttft_s),
        "tpot_s": rounded(tpot_s),
        "e2e_s": rounded(e2e_s),
        "queue_s": rounded(queue_s),
        "backend": backend,
        "upstream_ttft_s": rounded(upstream_ttft_s),
        "resumes": as_int(meta.get(RESUMES_FIELD)),
        "disconnects": as_int(meta.get(DISCONNECTS_FIELD)),
        "ended_by": ended_by,
    }
    summary_log.info("stream summary", extra=extra)
