"""The gateway's Starlette application: every route, listed in one place.

:func:`create_app` builds the :class:`gateway.state.Gateway` for its settings,
puts it on ``app.state.gateway`` and mounts the routes of each part:

- ``/v1/ws``: the WebSocket (gateway/ws/connection.py);
- ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` (gateway/http/openai.py);
- ``/v1/streams/{id}/events`` and ``/cancel`` (gateway/http/streams.py);
- ``/v1/ws-token`` (gateway/http/ws_token.py);
- ``/metrics`` (gateway/observe/metrics_route.py), ``/healthz``, ``/readyz``
  (gateway/observe/health.py);
- ``/``, ``/embed-demo`` and ``/static`` (gateway/http/pages.py).

A new route goes in its part's ``routes(gateway)`` and, for a new part, one
line in :func:`routes` below.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import BaseRoute, WebSocketRoute

from tokenrelay.gateway.access.cors import CORSMiddleware
from tokenrelay.gateway.access.hosts import HostCheckMiddleware, HostPolicy
from tokenrelay.gateway.http import openai, pages, streams, ws_token
from tokenrelay.gateway.observe import health, metrics_route
from tokenrelay.gateway.observe.metrics_route import HttpErrorCounter
from tokenrelay.gateway.state import Gateway, Settings
from tokenrelay.gateway.ws.connection import websocket_endpoint

__all__ = ["Gateway", "Settings", "create_app", "routes"]


def routes(gw: Gateway, extra: Sequence[BaseRoute] = ()) -> list[BaseRoute]:
    """Every route of the gateway, in matching order (``extra`` just before the pages)."""
    return [
        WebSocketRoute("/v1/ws", websocket_endpoint),
        *health.routes(gw.streams, lambda: gw.shutting_down),
        *openai.routes(gw),
        *streams.routes(gw),
        *ws_token.routes(gw.guard),
        *metrics_route.routes(gw.metrics),
        *extra,
        *pages.page_routes(),
    ]


def create_app(settings: Settings, *, extra_routes: Sequence[BaseRoute] = ()) -> Starlette:
    """The gateway application for ``settings`` (``extra_routes`` go before the pages)."""
    gw = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    sec = settings.security
    hosts = Middleware(HostCheckMiddleware, policy=HostPolicy(sec.allowed_hosts, sec.bind_host))
    cors = Middleware(CORSMiddleware, policy=gw.guard.origins)
    errors = Middleware(HttpErrorCounter, metrics=gw.metrics)
    middleware = [hosts, errors, cors]  # outermost first
    app = Starlette(routes=routes(gw, extra_routes), lifespan=lifespan, middleware=middleware)
    app.state.gateway = gw
    return app
