"""``/healthz`` (the process answers) and ``/readyz`` (it can serve a request now)."""

from __future__ import annotations

import contextlib

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from tokenrelay.gateway.state import Gateway


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """200 when Redis answers and a worker that is not draining is alive, else 503."""
    gw: Gateway = request.app.state.gateway
    redis_ok = await gw.streams.ping()
    workers: list[str] = []
    draining = 0
    if redis_ok:
        with contextlib.suppress(Exception):
            workers = await gw.streams.live_workers(max_age=0)
            draining = sum(await gw.streams.workers_draining(workers))
    ready = redis_ok and len(workers) > draining and not gw.shutting_down
    body = {"ready": ready, "redis": redis_ok, "workers": len(workers), "draining": draining}
    return JSONResponse(body, status_code=200 if ready else 503)


def routes() -> list[BaseRoute]:
    return [Route("/healthz", healthz), Route("/readyz", readyz)]
