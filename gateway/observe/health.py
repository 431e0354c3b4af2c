"""``/healthz`` (the process answers) and ``/readyz`` (it can serve a request now)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

if TYPE_CHECKING:
    from tokenrelay.gateway.streams.store import StreamStore


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def routes(streams: StreamStore, draining: Callable[[], bool]) -> list[BaseRoute]:
    """``/healthz`` and ``/readyz`` of a gateway (listed in gateway/app.py)."""

    async def readyz(request: Request) -> Response:
        """200 when Redis answers and a worker that is not draining is alive, else 503."""
        redis_ok = await streams.ping()
        workers: list[str] = []
        n_draining = 0
        if redis_ok:
            with contextlib.suppress(Exception):
                workers = await streams.live_workers(max_age=0)
                n_draining = sum(await streams.workers_draining(workers))
        ready = redis_ok and len(workers) > n_draining and not draining()
        body = {"ready": ready, "redis": redis_ok, "workers": len(workers), "draining": n_draining}
        return JSONResponse(body, status_code=200 if ready else 503)

    return [Route("/healthz", healthz), Route("/readyz", readyz)]
