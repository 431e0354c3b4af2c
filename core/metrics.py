"""Engine workers' stats snapshots as Prometheus metric families, built one way for all.

A gateway's ``/metrics`` (gateway/observe/metrics.py) exposes the snapshots of every
live worker, read from Redis; a worker's own ``/metrics`` (worker/health.py,
``--health-port``) exposes its own. Both build the families here, so a figure has one
name, one help text and one ``worker_id`` label wherever it is scraped.
docs/operations.md ("Metrics") lists them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from tokenrelay.core.wire.events import FINISH_REASONS
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.core.wire.telemetry import BUCKETS, RELAY_ONLY, Hist

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

NS = "tokenrelay_"
LABEL = "worker_id"

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
    "streams_continued": ("Streams taken over from a dead worker and continued.", "continued"),
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
# Latency histograms: stats name -> (metric name, help).
HISTOGRAMS = {
    "ttft": ("time_to_first_token_seconds", "Time from request to its first token."),
    "tpot": ("time_per_output_token_seconds", "Mean time between output tokens of a stream."),
    "itl": (
        "inter_token_latency_seconds",
        "Time between consecutive token events of a stream (one observation per gap).",
    ),
    "e2e": ("request_duration_seconds", "Time from request to its last event (end to end)."),
    "queue": ("queue_wait_seconds", "Time from request to its admission by an engine worker."),
    "upstream_ttft": (
        "upstream_time_to_first_token_seconds",
        "Relay workers: time from sending the upstream request to its first token.",
    ),
}


F = TypeVar("F", GaugeMetricFamily, CounterMetricFamily)


def _per_worker(family: F, workers: Mapping[str, WorkerStats], key: str) -> F:
    """``family`` with one sample per worker whose stats hold a number under ``key``."""
    for wid, stats in workers.items():
        value = stats.number(key)
        if value is not None:
            family.add_metric([wid], value)
    return family


def worker_families(workers: Mapping[str, WorkerStats]) -> Iterator[Metric]:
    """The gauges and counters of ``workers`` (by worker id), labelled ``worker_id``."""
    for name, (doc, key) in WORKER_GAUGES.items():
        yield _per_worker(GaugeMetricFamily(NS + name, doc, labels=[LABEL]), workers, key)
    used = GaugeMetricFamily(NS + "kv_blocks_used", "KV-cache blocks in use.", labels=[LABEL])
    rate = GaugeMetricFamily(
        NS + "prefix_cache_hit_rate",
        "Share of looked-up prompt tokens served from the prefix cache, since start.",
        labels=[LABEL],
    )
    draining = GaugeMetricFamily(
        NS + "worker_draining", "1 while the worker drains for shutdown.", labels=[LABEL]
    )
    info = GaugeMetricFamily(
        NS + "worker_info",
        "1 per worker, labelled with its backend (engine: our engine; upstream: a relay).",
        labels=[LABEL, "backend"],
    )
    served = GaugeMetricFamily(
        NS + "worker_models", "1 per model a worker serves.", labels=[LABEL, "model"]
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
        info.add_metric([wid, stats.backend], 1.0)
        for model in stats.models:
            served.add_metric([wid, model], 1.0)
    yield used
    yield rate
    yield draining
    yield info
    yield served
    for name, (doc, key) in WORKER_COUNTERS.items():
        yield _per_worker(CounterMetricFamily(NS + name, doc, labels=[LABEL]), workers, key)
    finished = CounterMetricFamily(
        NS + "requests_finished",
        "Streams the worker ended, by finish_reason.",
        labels=[LABEL, "finish_reason"],
    )
    for wid, stats in workers.items():
        for reason in FINISH_REASONS:
            value = stats.number(reason)
            if value is not None:
                finished.add_metric([wid, reason], value)
    yield finished


def histogram_families(
    workers: Mapping[str, WorkerStats], *, per_worker: bool = False
) -> Iterator[Metric]:
    """The latency histograms: summed over ``workers`` per ``backend`` (a gateway's view
    of the fleet), or with ``per_worker`` one labelled series per worker (a worker's own
    port). The relay-only ones (``upstream_ttft``) have series for relay workers only."""
    for key, (name, doc) in HISTOGRAMS.items():
        keeps = [
            (wid, s)
            for wid, s in workers.items()
            if key not in RELAY_ONLY or s.backend == "upstream"
        ]
        if per_worker:
            family = HistogramMetricFamily(NS + name, doc, labels=[LABEL])
            for wid, stats in keeps:
                mine = Hist.from_json(stats.hist.get(key)) or Hist(BUCKETS[key])
                family.add_metric([wid], mine.prometheus_buckets(), mine.sum)
            yield family
            continue
        totals: dict[str, Hist] = {}
        for _, stats in keeps:
            total = totals.setdefault(stats.backend, Hist(BUCKETS[key]))
            one = Hist.from_json(stats.hist.get(key))
            if one is not None:
                total.add(one)
        family = HistogramMetricFamily(NS + name, doc, labels=["backend"])
        for backend, total in sorted(totals.items()):
            family.add_metric([backend], total.prometheus_buckets(), total.sum)
        yield family
