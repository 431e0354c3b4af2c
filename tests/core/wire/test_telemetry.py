"""Latency histograms as they travel through Redis, and the collector's tolerance of bad stats."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.core.wire.telemetry import BUCKETS, Hist, log_summary
from tokenrelay.gateway.app import Settings, create_app
from tokenrelay.gateway.observe.metrics import ClusterView


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_hist_round_trips_and_adds() -> None:
    h = Hist(BUCKETS["ttft"])
    for v in (0.01, 0.05, 0.3, 0.3, 100.0, -1.0, float("nan")):
        h.observe(v)
    assert h.count == 5 and h.sum == pytest.approx(100.66)
    back = Hist.from_json(json.loads(json.dumps(h.to_json())))
    assert back is not None and back.counts == h.counts and back.sum == pytest.approx(h.sum)
    assert back.add(h) and back.count == 10
    buckets = dict(back.prometheus_buckets())
    assert buckets["0.025"] == 2 and buckets["0.05"] == 4 and buckets["+Inf"] == 10
    assert not back.add(Hist((1.0, 2.0)))  # other buckets are not mixed in


@pytest.mark.parametrize(
    "raw",
    [
        None,
        "x",
        {"le": [1.0], "cum": [1]},
        {"le": [2.0, 1.0], "cum": [1, 1, 1]},
        {"le": [1.0], "cum": [3, 1], "sum": 1},
        {"le": ["a"], "cum": [1, 1], "sum": 1},
        {"le": [1.0], "cum": [1, 1], "sum": "x"},
    ],
)
def test_malformed_hist_is_refused(raw: object) -> None:
    assert Hist.from_json(raw) is None


def _stats(flat: dict[str, Any]) -> WorkerStats:
    stats = WorkerStats.from_json(json.dumps(flat))
    assert stats is not None
    return stats


def test_collector_skips_garbage_worker_stats() -> None:
    app = create_app(Settings(redis_url="redis://127.0.0.1:1/0"))
    metrics = app.state.gateway.metrics
    good = Hist(BUCKETS["e2e"])
    good.observe(0.4)
    metrics.view = ClusterView(
        redis_up=True,
        workers={
            "w-good": _stats(
                {
                    "running": 2,
                    "blocks_total": 10,
                    "blocks_free": 7,
                    "length": 3,
                    "prefix_cache_hit_tokens": 5,
                    "prefix_cache_query_tokens": 20,
                    "hist": {"e2e": good.to_json()},
                }
            ),
            "w-bad": _stats(
                {
                    "running": "many",
                    "blocks_total": None,
                    "length": True,
                    "hist": {"e2e": {"le": "bad"}, "ttft": [1, 2]},
                }
            ),
        },
        queue_depth=4,
    )
    metrics.count_error("bad_request", "ws")
    got = samples(metrics.render().decode())
    assert got[("tokenrelay_sequences_running", (("worker_id", "w-good"),))] == 2
    assert ("tokenrelay_sequences_running", (("worker_id", "w-bad"),)) not in got
    assert got[("tokenrelay_kv_blocks_used", (("worker_id", "w-good"),))] == 3
    assert got[("tokenrelay_prefix_cache_hit_rate", (("worker_id", "w-good"),))] == 0.25
    key = (
        "tokenrelay_requests_finished_total",
        (("finish_reason", "length"), ("worker_id", "w-good")),
    )
    assert got[key] == 3
    engine = ("backend", "engine")  # the fleet's histograms are summed per backend
    assert got[("tokenrelay_request_duration_seconds_count", (engine,))] == 1
    assert got[("tokenrelay_request_duration_seconds_bucket", (engine, ("le", "0.5")))] == 1
    assert got[("tokenrelay_worker_info", (engine, ("worker_id", "w-good")))] == 1
    assert not [k for k in got if k[0].startswith("tokenrelay_upstream_time_to_first")]
    assert got[("tokenrelay_queue_depth", ())] == 4 and got[("tokenrelay_workers", ())] == 2
    assert got[("tokenrelay_errors_total", (("code", "bad_request"), ("transport", "ws")))] == 1


def test_two_apps_in_one_process_keep_separate_registries() -> None:
    a = create_app(Settings(redis_url="redis://127.0.0.1:1/0")).state.gateway.metrics
    b = create_app(Settings(redis_url="redis://127.0.0.1:1/0")).state.gateway.metrics
    a.count_error("internal", "http")
    key = ("tokenrelay_errors_total", (("code", "internal"), ("transport", "http")))
    assert samples(a.render().decode())[key] == 1
    assert key not in samples(b.render().decode())


def test_summary_line_fields(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tokenrelay.summary"):
        log_summary(stream_id="s1", request_id="r1", finish_reason="stop", prompt_tokens=3,
                    completion_tokens=2, meta={"rs": "2", "dc": "junk"}, ended_by="w",
                    ttft_s=0.123456, tpot_s=None)  # fmt: skip
    (rec,) = caplog.records
    assert rec.getMessage() == "stream summary"
    fields = vars(rec)
    assert fields["request_id"] == "r1" and fields["stream_id"] == "s1"
    assert fields["resumes"] == 2 and fields["disconnects"] == 0
    assert fields["ttft_s"] == 0.1235 and fields["tpot_s"] is None
