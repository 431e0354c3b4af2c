"""The models of the live workers, and the request queue a request for one goes to.

Every worker announces the names of the models it serves in its stats snapshot
(core/wire/stats.py ``models``: an engine worker its ``--model-name`` or ``--model``,
a relay its ``--upstream-model`` names or the upstream's list) and reads their
request queues (``P requests:<model>``, core/wire/keys.py). A gateway reads the
announcements with the heartbeats it already follows and routes each request:

- a request that names a served model goes to that model's queue;
- a request that names no model, or the gateway's ``--model-name`` (``default``
  when not set) that no worker serves, goes to the *default* model: the gateway's
  ``--model-name`` when a worker serves it, else a model named ``default``, else the
  first model of an engine worker (workers in id order, models as announced), else
  the first model of any worker;
- a worker that names no model (older or test workers) reads ``P requests``, the
  queue of requests that name none, when no named model is the default;
- any other name is :class:`UnknownModel` at once (HTTP 404 ``model_not_found``, a
  WebSocket ``not_found`` error), never a request that waits for nobody.

A worker that dies takes its models out of the list once its heartbeat expires
(3 s); requests already queued for them stay queued until a worker serves the model
again, as for a single model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.gateway.errors import NoWorker, UnknownModel

if TYPE_CHECKING:
    from tokenrelay.gateway.streams.store import StreamStore

DEFAULT_NAME = "default"  # what the unnamed model is called when the gateway names none
CACHE_S = 1.0  # seconds a look at the workers is reused (a miss looks again at once)


@dataclass(frozen=True)
class Route:
    """Where a request goes: ``name`` for its answers, ``model`` for its queue
    (``None``: ``P requests``, the queue of workers that name no model)."""

    name: str
    model: str | None


@dataclass(frozen=True)
class Served:
    """The models the live workers serve (a snapshot)."""

    models: dict[str, str] = field(default_factory=dict)  # name -> backend, default first
    unnamed: bool = False  # a live worker names no model
    alias: str | None = None  # the gateway's --model-name

    @classmethod
    def of(cls, workers: list[WorkerStats], alias: str | None = None) -> Served:
        """What ``workers`` (in worker id order) serve; engine workers' models first."""
        engines = [s for s in workers if s.backend == "engine"]
        others = [s for s in workers if s.backend != "engine"]
        models: dict[str, str] = {}
        for stats in engines + others:
            for name in stats.models:
                models.setdefault(name, stats.backend)
        return cls(models, any(not s.models for s in workers), alias)

    @property
    def live(self) -> bool:
        return bool(self.models) or self.unnamed

    def default(self) -> Route:
        """The route of a request that names no model."""
        for name in (self.alias, DEFAULT_NAME):
            if name is not None and name in self.models:
                return Route(name, name)
        shown = self.alias or DEFAULT_NAME
        if self.unnamed or not self.models:
            return Route(shown, None)
        first = next(iter(self.models))
        return Route(first, first)

    def resolve(self, requested: str | None) -> Route:
        """The route of a request for ``requested`` (``None``: it names none).

        Raises :class:`UnknownModel` when live workers serve no model of that name.
        """
        if requested is not None and requested in self.models:
            return Route(requested, requested)
        if requested is None or requested == (self.alias or DEFAULT_NAME):
            route = self.default()
            return route if requested is None else Route(requested, route.model)
        shown = requested if len(requested) <= 80 else requested[:80] + "..."
        listed = ", ".join(f"`{n}`" for n in self.names()[:8]) or "none"
        raise UnknownModel(f"The model `{shown}` does not exist. Served models: {listed}.")

    def names(self) -> list[str]:
        """The model names ``GET /v1/models`` lists: the served ones, and the gateway's
        ``--model-name`` (or ``default``) where it names what requests naming none get,
        also while no worker has announced a model yet (one still loading it)."""
        out = list(self.models)
        alias = self.alias or DEFAULT_NAME
        if alias not in out and (self.unnamed or not self.models or self.alias is not None):
            out.insert(0, alias)
        return out


class ModelDirectory:
    """The served models as one gateway sees them (live workers, cached a second)."""

    def __init__(self, streams: StreamStore, alias: str | None = None) -> None:
        self.streams = streams
        self.alias = alias
        self._cache: tuple[float, Served] | None = None

    async def served(self, *, fresh: bool = False) -> Served:
        """The live workers' models (read again when ``fresh`` or older than a second).

        Draining workers count: requests queued for their models wait for the next worker
        (a rolling restart is no 404). Raises ``RedisUnavailable``.
        """
        now = time.monotonic()
        if not fresh and self._cache is not None and now - self._cache[0] < CACHE_S:
            return self._cache[1]
        workers = await self.streams.live_workers(max_age=0 if fresh else CACHE_S)
        stats = await self.streams.worker_stats(workers) if workers else []
        served = Served.of([s for s in stats if s is not None], self.alias)
        self._cache = (time.monotonic(), served)
        return served

    async def resolve(self, requested: str | None) -> tuple[Served, Route]:
        """The route of a request for ``requested``, looking again before an unknown name
        is refused (a worker may have just come up). Raises :class:`UnknownModel`,
        :class:`NoWorker` when no worker is alive at all, ``RedisUnavailable``."""
        served = await self.served()
        try:
            return served, served.resolve(requested)
        except UnknownModel:
            served = await self.served(fresh=True)
        if not served.live:
            raise NoWorker("no engine worker is running")
        return served, served.resolve(requested)
