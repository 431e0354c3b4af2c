"""Prometheus metrics of one gateway, with the engine workers' figures read from Redis.

Each :class:`GatewayMetrics` has its own ``CollectorRegistry`` (several apps in
one process never collide). A scrape of ``/metrics`` (gateway/observe/metrics_route.py)
first reads, in one Redis round trip or two, the stats snapshot every live
engine worker publishes once a second (``P w:{worker_id}`` field ``stats``)
and the request queue's depth; a custom collector then exposes:

- per worker (label ``worker_id``): its gauges (streams, running and waiting
  sequences, KV blocks, prefix-cache hit rate, draining) and counters
  (generated tokens, requests by ``finish_reason``, detach expiries,
  preemptions, ...), as the worker counts them since it started;
- the workers' latency histograms (TTFT, TPOT, end to end, queue wait),
  summed over the live workers;
- this gateway's own figures: open WebSockets, attached streams, resumes and
  events replayed, cancels, disconnects, errors by code and transport.

docs/operations.md lists every metric.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from core.redis.connection import is_outage
from core.wire.events import FINISH_REASONS
from core.wire.keys import GROUP
from core.wire.stats import STATS_FIELD, WorkerStats
from core.wire.telemetry import BUCKETS, Hist

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from gateway.state import Gateway

log = logging.getLogger("tokenrelay.metrics")

NS = "tokenrelay_"

# Per-worker gauges: metric name -> (help, stats key).
WORKER_GAUGES = {
    "streams_active": ("Streams the engine worker is producing.", "active_streams"),
    "sequences_running": ("Sequences in the running batch.", "running"),
    "sequences_waiting": ("Sequences waiting for room in the batch.", "waiting"),
    "kv_blocks_free": ("KV-cache blocks free (cached-free included).", "blocks_free"),
    "kv_blocks_total": ("KV-cache blocks in the pool.", "blocks_total"),
    "kv_blocks_cached": ("KV-cache blocks registered in the prefix cache.", "blocks_cached"),
}
# Per-worker counters: metric name (without _total) -> (help, stats key).
WORKER_COUNTERS = {
    "generated_tokens": ("Tokens generated.", "generated_tokens"),
    "prompt_tokens_computed": (
        "Prompt tokens prefilled (recomputes included).",
        "prompt_tokens_computed",
    ),
    "requests_started": ("Requests taken by the worker.", "requests"),
    "requests_rejected": ("Requests the worker refused (bad input).", "rejected"),
    "detach_expiries": (
        "Streams aborted after no client was attached for the detach timeout.",
        "expired",
    ),
    "preemptions": ("Sequences preempted (their KV recomputed later).", "preemptions"),
    "prefix_cache_hit_tokens": (
        "Prompt tokens served from the prefix cache.",
        "prefix_cache_hit_tokens",
    ),
    "prefix_cache_query_tokens": (
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_query_tokens",
    ),
    "engine_steps": ("Engine steps run.", "num_steps"),
    "engine_step_seconds": ("Seconds spent in engine steps.", "step_seconds"),
}
# Histograms (summed over workers): stats name -> (metric name, help).
HISTOGRAMS = {
    "ttft": ("time_to_first_token_seconds", "Time from request to its first token."),
    "tpot": ("time_per_output_token_seconds", "Mean time between output tokens of a stream."),
    "e2e": ("request_duration_seconds", "Time from request to its last event (end to end)."),
    "queue": ("queue_wait_seconds", "Time from request to its admission by an engine worker."),
}


F = TypeVar("F", GaugeMetricFamily, CounterMetricFamily)


def _per_worker(family: F, workers: Mapping[str, WorkerStats], key: str) -> F:
    """``family`` with one sample per worker whose stats hold a number under ``key``."""
    for wid, stats in workers.items():
        value = stats.number(key)
        if value is not None:
            family.add_metric([wid], value)
    return family


@dataclass
class ClusterView:
    """What the last scrape read from Redis."""

    redis_up: bool = False
    workers: dict[str, WorkerStats] = field(default_factory=dict)  # by worker id
    queue_depth: int | None = None


class GatewayMetrics:
    """The metrics registry of one gateway process."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.registry = CollectorRegistry(auto_describe=False)
        self.errors = Counter(
            NS + "errors",
            "Errors sent to clients, by protocol error code and transport (ws, http).",
            ["code", "transport"],
            registry=self.registry,
        )
        self.view = ClusterView()
        self.registry.register(_Collector(self))

    def count_error(self, code: str, transport: str) -> None:
        """One more error answered with ``code`` over ``transport``."""
        self.errors.labels(code=str(code)[:40], transport=transport).inc()

    async def refresh(self) -> None:
        """Read the live workers' stats and the queue depth from Redis."""
        slog = self.gw.streams
        view = ClusterView()
        try:
            ids = await slog.live_workers(max_age=0)
            pipe = slog.redis.pipeline(transaction=False)
            for wid in ids:
                pipe.hget(slog.keys.worker(wid), STATS_FIELD)
            pipe.xlen(slog.keys.requests)
            pipe.xpending(slog.keys.requests, GROUP)
            replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:
            if not is_outage(exc):
                log.warning("metrics: reading worker stats failed: %r", exc)
            self.view = view
            return
        view.redis_up = True
        for wid, raw in zip(ids, replies, strict=False):
            stats = WorkerStats.from_json(raw)
            if stats is not None:
                view.workers[wid] = stats
        length, pending = replies[len(ids)], replies[len(ids) + 1]
        if isinstance(length, int):
            taken = pending.get("pending", 0) if isinstance(pending, dict) else 0
            view.queue_depth = max(0, length - int(taken or 0))
        self.view = view

    def render(self) -> bytes:
        """The text exposition of every metric (call :meth:`refresh` first)."""
        return bytes(generate_latest(self.registry))


class _Collector(Collector):
    """Exposes the cluster view and this gateway's live figures at scrape time."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self._gateway()
        yield from self._workers()
        yield from self._histograms()

    def _gateway(self) -> Iterator[Metric]:
        gw = self.metrics.gw
        slog = gw.streams
        view = self.metrics.view
        gauges: dict[str, tuple[str, float]] = {
            "websocket_connections": ("Open WebSocket connections.", len(gw.connections)),
            "gateway_streams_attached": (
                "Unfinished streams a client of this gateway is attached to.",
                len(slog.attachments.tracked),
            ),
            "gateway_draining": ("1 while this gateway drains for shutdown.", gw.shutting_down),
            "live_feed_up": (
                "1 while this gateway is subscribed to the live feed of appends.",
                slog.tailer.feed.up,
            ),
            "redis_up": ("1 when the last scrape could read Redis.", view.redis_up),
            "workers": ("Engine workers with a live heartbeat.", len(view.workers)),
        }
        if view.queue_depth is not None:
            gauges["queue_depth"] = (
                "Requests queued in Redis that no engine worker has taken yet.",
                view.queue_depth,
            )
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(NS + name, doc, value=float(value))
        counters = {
            "resumes": ("Stream resumes served by this gateway.", slog.resumes),
            "resume_events_replayed": (
                "Events replayed to resuming clients.",
                slog.events_replayed,
            ),
            "cancel_requests": ("Cancels accepted for unfinished streams.", slog.cancels),
            "disconnects": ("Clients that left a stream before its end.", slog.disconnects),
            "live_feed_messages": (
                "Messages of the live feed of appends received by this gateway.",
                slog.tailer.feed.messages,
            ),
            "catch_up_reads": (
                "Reads of stream logs for subscribers behind the live feed (XREAD calls).",
                slog.tailer.catch_up_reads,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(NS + name, doc, value=float(value))

    def _workers(self) -> Iterator[Metric]:
        workers = self.metrics.view.workers
        for name, (doc, key) in WORKER_GAUGES.items():
            yield _per_worker(GaugeMetricFamily(NS + name, doc, labels=["worker_id"]), workers, key)
        used = GaugeMetricFamily(
            NS + "kv_blocks_used", "KV-cache blocks in use.", labels=["worker_id"]
        )
        rate = GaugeMetricFamily(
            NS + "prefix_cache_hit_rate",
            "Share of looked-up prompt tokens served from the prefix cache, since start.",
            labels=["worker_id"],
        )
        draining = GaugeMetricFamily(
            NS + "worker_draining", "1 while the worker drains for shutdown.", labels=["worker_id"]
        )
        for wid, stats in workers.items():
            total, free = stats.number("blocks_total"), stats.number("blocks_free")
            if total is not None and free is not None:
                used.add_metric([wid], max(0.0, total - free))
            hit = stats.number("prefix_cache_hit_tokens")
            query = stats.number("prefix_cache_query_tokens")
            if hit is not None and query:
                rate.add_metric([wid], hit / query)
            draining.add_metric([wid], 1.0 if stats.draining else 0.0)
        yield used
        yield rate
        yield draining
        for name, (doc, key) in WORKER_COUNTERS.items():
            c = CounterMetricFamily(NS + name, doc, labels=["worker_id"])
            yield _per_worker(c, workers, key)
        finished = CounterMetricFamily(
            NS + "requests_finished",
            "Streams the worker ended, by finish_reason.",
            labels=["worker_id", "finish_reason"],
        )
        for wid, stats in workers.items():
            for reason in FINISH_REASONS:
                value = stats.number(reason)
                if value is not None:
                    finished.add_metric([wid, reason], value)
        yield finished

    def _histograms(self) -> Iterator[Metric]:
        workers = self.metrics.view.workers
        for key, (name, doc) in HISTOGRAMS.items():
            total = Hist(BUCKETS[key])
            for stats in workers.values():
                one = Hist.from_json(stats.hist.get(key))
                if one is not None:
                    total.add(one)
            yield HistogramMetricFamily(
                NS + name, doc, buckets=total.prometheus_buckets(), sum_value=total.sum
            )
