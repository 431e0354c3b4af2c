"""Prometheus metrics of one gateway, with the engine workers' figures read from Redis.

Each :class:`GatewayMetrics` has its own ``CollectorRegistry`` (several apps in
one process never collide). A scrape of ``/metrics`` (gateway/observe/metrics_route.py)
first reads, in one Redis round trip or two, the stats snapshot every live
engine worker publishes once a second (``P w:<worker_id>`` field ``stats``)
and the depth of the request queues (every served model's, and ``P requests``); a
custom collector then exposes:

- per worker (label ``worker_id``): its gauges (streams, running and waiting
  sequences, KV blocks, prefix-cache hit rate, draining) and counters
  (generated tokens, requests by ``finish_reason``, detach expiries,
  preemptions, ...), as the worker counts them since it started;
- each worker's backend (``worker_info``) and models (``worker_models``);
- the workers' latency histograms (TTFT, TPOT, end to end, queue wait; a relay's
  upstream TTFT), summed over the live workers by ``backend`` (these families are
  built in core/metrics.py, which a worker's own ``/metrics`` shares);
- this gateway's own figures: open WebSockets, attached streams, resumes and
  events replayed, cancels, disconnects, errors by code and transport, and the
  delivery latency of live events (a worker's append to the client's socket).

docs/operations.md lists every metric.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from tokenrelay.core.metrics import NS, histogram_families, worker_families
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.gateway.errors import RedisFull, RedisUnavailable

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from tokenrelay.gateway.streams.store import StreamStore

log = logging.getLogger("tokenrelay.metrics")


@dataclass
class ClusterView:
    """What the last scrape read from Redis."""

    redis_up: bool = False
    workers: dict[str, WorkerStats] = field(default_factory=dict)  # by worker id
    queue_depth: int | None = None


class GatewayMetrics:
    """The metrics registry of one gateway process."""

    def __init__(self, streams: StreamStore, sockets: Sized, draining: Callable[[], bool]) -> None:
        self.streams = streams
        self.sockets = sockets  # the gateway's open WebSockets (a live set)
        self.draining = draining
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
        streams = self.streams
        view = ClusterView()
        try:
            ids = await streams.live_workers(max_age=0)
            stats = dict(zip(ids, await streams.worker_stats(ids), strict=True))
            models = sorted({m for s in stats.values() if s for m in s.models})
            depth = await streams.queue_depth([*models, None])
        except Exception as exc:
            if not isinstance(exc, RedisUnavailable | RedisFull):
                log.warning("metrics: reading worker stats failed: %r", exc)
            self.view = view
            return
        view.redis_up = True
        view.workers = {wid: s for wid, s in stats.items() if s is not None}
        view.queue_depth = depth
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
        metrics = self.metrics
        streams = metrics.streams
        view = self.metrics.view
        gauges: dict[str, tuple[str, float]] = {
            "websocket_connections": ("Open WebSocket connections.", len(metrics.sockets)),
            "gateway_streams_attached": (
                "Unfinished streams a client of this gateway is attached to.",
                len(streams.attachments.tracked),
            ),
            "gateway_draining": ("1 while this gateway drains for shutdown.", metrics.draining()),
            "live_feed_up": (
                "1 while this gateway is subscribed to the live feed of appends.",
                streams.tailer.feed.up,
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
            "resumes": ("Stream resumes served by this gateway.", streams.resumes),
            "resume_events_replayed": (
                "Events replayed to resuming clients.",
                streams.events_replayed,
            ),
            "cancel_requests": ("Cancels accepted for unfinished streams.", streams.cancels),
            "disconnects": ("Clients that left a stream before its end.", streams.disconnects),
            "live_feed_messages": (
                "Messages of the live feed of appends received by this gateway.",
                streams.tailer.feed.messages,
            ),
            "catch_up_reads": (
                "Reads of stream logs for subscribers behind the live feed (XREAD calls).",
                streams.tailer.catch_up_reads,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(NS + name, doc, value=float(value))
        delivery = HistogramMetricFamily(
            NS + "delivery_latency_seconds",
            "Live events: from the worker's append (Redis' clock) to the client's socket, "
            "one observation per append batch of a stream.",
            labels=[],
        )
        delivery.add_metric([], streams.delivery.prometheus_buckets(), streams.delivery.sum)
        yield delivery

    def _workers(self) -> Iterator[Metric]:
        yield from worker_families(self.metrics.view.workers)

    def _histograms(self) -> Iterator[Metric]:
        yield from histogram_families(self.metrics.view.workers)
