"""gateway/streams/routing.py: which model a request names, and which queue it goes to."""

from __future__ import annotations

import pytest

from tokenrelay.core.wire.keys import Keys
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.gateway.errors import UnknownModel
from tokenrelay.gateway.streams.routing import Route, Served


def worker(backend: str, *models: str) -> WorkerStats:
    return WorkerStats(backend=backend, models=list(models))


def test_one_engine_model_is_the_default_and_the_only_name() -> None:
    served = Served.of([worker("engine", "default")])
    assert served.names() == ["default"]
    assert served.resolve(None) == Route("default", "default")
    assert served.resolve("default") == Route("default", "default")
    with pytest.raises(UnknownModel, match=r"`gpt-4` does not exist\. Served models: `default`"):
        served.resolve("gpt-4")


def test_a_mixed_fleet_routes_each_model_to_its_queue_and_defaults_to_an_engine_model() -> None:
    served = Served.of([worker("upstream", "llama", "qwen"), worker("engine", "smol")])
    assert served.names() == ["smol", "llama", "qwen"]  # engine models first
    assert served.resolve(None) == Route("smol", "smol")
    assert served.resolve("qwen") == Route("qwen", "qwen")
    assert served.models == {"smol": "engine", "llama": "upstream", "qwen": "upstream"}
    assert Keys("p:").queue("qwen") == "p:requests:qwen"
    with pytest.raises(UnknownModel):
        served.resolve("mistral")


def test_the_gateways_model_name_picks_the_default_or_names_it() -> None:
    fleet = [worker("engine", "smol"), worker("upstream", "llama")]
    assert Served.of(fleet, "llama").resolve(None) == Route("llama", "llama")
    # a name nobody serves: what the gateway calls its default model (a split setup
    # whose worker was started without --model-name)
    named = Served.of([worker("engine", "/models/smol")], "chat")
    assert named.names() == ["chat", "/models/smol"]
    assert named.resolve("chat") == Route("chat", "/models/smol")
    assert named.resolve(None) == Route("/models/smol", "/models/smol")


def test_workers_that_name_no_model_serve_the_requests_that_name_none() -> None:
    served = Served.of([WorkerStats()])
    assert served.names() == ["default"]
    assert served.resolve(None) == Route("default", None)  # P requests
    assert served.resolve("default") == Route("default", None)
    assert Keys("p:").queue(None) == "p:requests"
    with pytest.raises(UnknownModel):
        served.resolve("other")


def test_no_live_worker_lists_the_default_name_and_refuses_every_other() -> None:
    served = Served.of([])  # e.g. the one worker still loading its model
    assert served.names() == ["default"] and not served.live
    assert Served.of([], alias="mine").names() == ["mine"]
    assert served.resolve(None) == Route("default", None)  # the store says: no worker
    with pytest.raises(UnknownModel, match="Served models: `default`"):
        served.resolve("x")


def test_a_model_named_default_is_the_default_and_is_never_shadowed() -> None:
    served = Served.of([worker("upstream", "alpha"), worker("upstream", "default")])
    assert served.resolve(None) == Route("default", "default")
    assert served.resolve("default") == Route("default", "default")
    assert served.names() == ["alpha", "default"]
