"""core/wire/stats.py: the worker's stats snapshot round-trips and refuses garbage."""

from __future__ import annotations

import json

import pytest

from tokenrelay.core.wire.keys import MAX_MODEL_NAME
from tokenrelay.core.wire.stats import COUNTERS, MAX_MODELS, WorkerStats, checked_models


def test_round_trip_keeps_every_figure() -> None:
    stats = WorkerStats(
        worker_id="w1",
        draining=True,
        active_streams=3,
        counters={"requests": 5, "stop": 2, "length": 1},
        engine={"blocks_total": 100, "blocks_free": 40, "step_seconds": 1.5},
        hist={"ttft": {"b": [0.1], "c": [1, 0], "s": 0.05}},
        backend="upstream",
        models=["alpha", "org/beta:7b"],
    )
    back = WorkerStats.from_json(stats.to_json())
    assert back == stats
    assert back.number("blocks_free") == 40.0
    assert back.number("stop") == 2.0
    assert back.number("active_streams") == 3.0
    assert back.number("missing") is None


def test_the_wire_form_is_one_flat_object() -> None:
    flat = json.loads(WorkerStats("w", counters={"error": 1}, engine={"running": 2}).to_json())
    assert flat == {
        "error": 1,
        "running": 2,
        "active_streams": 0,
        "worker_id": "w",
        "draining": False,
        "hist": {},
        "backend": "engine",
        "models": [],
    }
    assert set(COUNTERS) >= {"requests", "rejected", "stop", "length", "cancelled", "error"}


def test_garbage_is_none_and_odd_fields_are_dropped() -> None:
    for raw in (None, 3, b"not json", "[1, 2]", '"text"'):
        assert WorkerStats.from_json(raw) is None
    odd = WorkerStats.from_json('{"draining": "yes", "running": true, "hist": 4, "x": "y"}')
    assert odd == WorkerStats()  # a non-boolean draining is not draining; non-numbers dropped


def test_announced_models_are_checked_on_the_way_in() -> None:
    raw = json.dumps(
        {"backend": "gpu", "models": ["a", "", 3, "a", "x" * (MAX_MODEL_NAME + 1), "b"]}
    )
    back = WorkerStats.from_json(raw)
    assert back is not None
    assert back.models == ["a", "b"]  # strings of 1..MAX_MODEL_NAME characters, each once
    assert back.backend == "engine"  # an unknown backend is not believed
    assert WorkerStats.from_json('{"models": "a"}') == WorkerStats()


def test_a_worker_refuses_a_bad_model_name_with_one_line() -> None:
    assert checked_models(["a", "b", "a"], "--upstream-model") == ["a", "b"]
    for bad in ("", "x" * (MAX_MODEL_NAME + 1), "tab\there"):
        with pytest.raises(ValueError, match="--model-name: a model name is 1 to"):
            checked_models([bad], "--model-name")
    with pytest.raises(ValueError, match="at most"):
        checked_models([f"m{i}" for i in range(MAX_MODELS + 1)], "--upstream-model")
