"""Whether an engine worker is ready, followed once a second and told to every socket.

A gateway comes up before its worker has loaded the model (``serve`` starts them
together; a fleet adds workers later). Until a worker's heartbeat is in Redis a
generate gets ``unavailable``. Instead of a page that says "Connected" and then
fails, the ``hello`` frame carries ``worker_ready``, and a socket told ``false``
gets one ``worker_ready`` notice as soon as a worker is; pages hold their send
button meanwhile (static/app.js, static/widget.js). A socket told ``true`` gets
no notice when workers come and go (its generates get ``unavailable`` then, as
before): readiness notices never interleave with the frames of running streams.
``/readyz`` reads the same state from Redis.

The same look gives the served model's context (``max_model_len`` in the
workers' stats), which bounds the characters a request may carry
(:meth:`core.wire.requests.Limits.for_context`), and its vocabulary
(``vocab_size``), which bounds the token ids of ``logit_bias`` and
``stop_token_ids``, and whether every worker runs our engine, which takes text only
(then image content parts are refused here, not queued for a worker to refuse).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.gateway.drain import notice_frame
from tokenrelay.gateway.errors import RedisUnavailable

if TYPE_CHECKING:
    from tokenrelay.gateway.drain import ClientSocket
    from tokenrelay.gateway.streams.store import StreamStore

log = logging.getLogger("tokenrelay.app")

POLL_S = 1.0

READY = ("worker_ready", "an engine worker is ready")


async def serving_workers(streams: StreamStore, *, fresh: bool = False) -> list[WorkerStats]:
    """The stats of the live workers that are not draining (the list cached for a second
    unless ``fresh``)."""
    workers = await streams.live_workers(max_age=0 if fresh else 1.0)
    if not workers:
        return []
    stats = await streams.worker_stats(workers)
    return [s for s in stats if s is not None and not s.draining]


def context_tokens(workers: list[WorkerStats]) -> int | None:
    """The largest context among ``workers`` (``None`` when none publishes one)."""
    sizes = [int(n) for s in workers if (n := s.number("max_model_len"))]
    return max(sizes) if sizes else None


def vocab_size(workers: list[WorkerStats]) -> int | None:
    """The smallest vocabulary among ``workers`` (``None`` when none publishes one)."""
    sizes = [int(n) for s in workers if (n := s.number("vocab_size"))]
    return min(sizes) if sizes else None


def text_only(workers: list[WorkerStats]) -> bool | None:
    """Whether every one of ``workers`` runs our engine, none a relay (``None``: no
    worker, nothing known)."""
    return all(s.backend == "engine" for s in workers) if workers else None


class ReadinessWatch:
    """Keeps ``ready`` current; tells the sockets waiting for a worker when one is."""

    def __init__(
        self,
        streams: StreamStore,
        sockets: Collection[ClientSocket],
        follow_context: Callable[[int | None, int | None, bool | None], None],
    ) -> None:
        self.streams = streams
        self.sockets = sockets  # the gateway's open sockets (a live set)
        # the workers' context and vocabulary sizes, and whether all run our engine
        self.follow_context = follow_context
        self.ready = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="readiness")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def check(self, *, fresh: bool = False) -> bool:
        """Look now; log a change; once ready, tell the sockets whose hello said not ready.

        ``fresh``: past the one-second cache (a new socket's hello must not lag
        ``/readyz``, which reads Redis directly).
        """
        try:
            workers = await serving_workers(self.streams, fresh=fresh)
        except RedisUnavailable:
            workers = []
        ready = bool(workers)
        self.follow_context(context_tokens(workers), vocab_size(workers), text_only(workers))
        if ready != self.ready:
            self.ready = ready
            log.info("worker readiness", extra={"worker_ready": ready})
        if ready:
            waiting = [c for c in self.sockets if c.waiting_for_worker]
            for conn in waiting:
                conn.waiting_for_worker = False
                with contextlib.suppress(Exception):  # closing meanwhile, or not reading
                    await asyncio.wait_for(conn.send(notice_frame(*READY)), 1.0)
        return ready

    async def _run(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:  # never let the watch die: log and look again
                log.exception("worker readiness check failed")
            await asyncio.sleep(POLL_S)
