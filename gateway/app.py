"""The gateway's Starlette application.

:func:`create_app` wires ``/v1/ws``, ``/healthz``, ``/readyz``, and ``/`` with
``/static`` (gateway/pages.py's ``page_routes()`` when present, else the
``static/`` folder and ``web/templates/index.html`` when they exist). Other
gateway features plug in without editing this file: every module
``gateway/api_*.py`` that defines ``routes(gateway) -> list[BaseRoute]`` gets
its routes mounted, and finds the shared :class:`Gateway` (settings, stream
log, connections) on ``request.app.state.gateway``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import pkgutil
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

import gateway
from gateway import protocol as p
from gateway.api_metrics import HttpErrorCounter
from gateway.cors import CORSMiddleware
from gateway.guard import Guard
from gateway.metrics import GatewayMetrics
from gateway.schema import DEFAULT_PREFIX
from gateway.security import SecuritySettings
from gateway.streamlog import StreamLog
from gateway.ws import websocket_endpoint

if TYPE_CHECKING:
    from gateway.ws import Connection

log = logging.getLogger("tokenrelay.app")

ROOT = Path(__file__).resolve().parent.parent
STATIC_DIR = ROOT / "static"
TEMPLATES_DIR = ROOT / "web" / "templates"


def _version() -> str:
    try:
        return metadata.version("tokenrelay")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass
class Settings:
    """Gateway settings (from the command line / environment)."""

    redis_url: str
    redis_prefix: str = DEFAULT_PREFIX
    heartbeat: float = 20.0
    max_frame_bytes: int = 1 << 20
    detach_timeout: float = 30.0
    stream_ttl: float = 3600.0
    max_connections: int = 10_000
    max_streams_per_connection: int = 64
    max_pending: int = 4096
    send_queue: int = 256
    model_name: str | None = None
    drain_timeout: float = 30.0
    security: SecuritySettings = field(default_factory=SecuritySettings)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        if not args.redis_url:
            raise ValueError("--redis-url is required (or TOKENRELAY_REDIS_URL)")
        return cls(
            redis_url=args.redis_url,
            redis_prefix=getattr(args, "redis_prefix", DEFAULT_PREFIX),
            heartbeat=args.heartbeat,
            max_frame_bytes=args.max_frame_bytes,
            detach_timeout=args.detach_timeout,
            stream_ttl=args.stream_ttl,
            max_connections=getattr(args, "max_connections", 10_000),
            max_streams_per_connection=getattr(args, "max_streams_per_connection", 64),
            max_pending=getattr(args, "max_pending", 4096),
            model_name=getattr(args, "model_name", None),
            drain_timeout=getattr(args, "drain_timeout", 30.0),
            security=SecuritySettings.from_args(args),
        )

    def __post_init__(self) -> None:
        if self.heartbeat <= 0:
            raise ValueError("--heartbeat must be > 0")
        if self.max_frame_bytes < 1024:
            raise ValueError("--max-frame-bytes must be >= 1024")
        if self.detach_timeout < 0 or self.stream_ttl < 1:
            raise ValueError("--detach-timeout must be >= 0 and --stream-ttl >= 1")
        if not self.drain_timeout >= 0:
            raise ValueError("--drain-timeout must be >= 0")


class Gateway:
    """Process-wide state of one gateway: settings, stream log, open sockets."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.limits = p.Limits(max_tokens=settings.security.max_tokens)
        self.log = StreamLog(
            settings.redis_url,
            prefix=settings.redis_prefix,
            stream_ttl=settings.stream_ttl,
            detach_timeout=settings.detach_timeout,
            max_pending=settings.max_pending,
        )
        self.guard = Guard(settings.security, self.log.redis, settings.redis_prefix)
        self.connections: set[Connection] = set()
        self.shutting_down = False
        self.metrics = GatewayMetrics(self)
        self.server_name = f"tokenrelay/{_version()}"

    async def start(self) -> None:
        await self.log.start()
        log.info("gateway started", extra={"gateway_id": self.log.gateway_id})

    async def close_connections(self, code: int = p.CLOSE_GOING_AWAY, wait: float = 2.0) -> None:
        """Close every WebSocket with ``code`` (1001 on shutdown) and wait for them."""
        self.shutting_down = True
        for conn in list(self.connections):
            conn.close(code, "gateway shutting down")
        deadline = asyncio.get_running_loop().time() + wait
        while self.connections and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        await self.close_connections()
        await self.log.close()


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    redis_ok = await gw.log.ping()
    workers: list[str] = []
    draining = 0
    if redis_ok:
        with contextlib.suppress(Exception):
            workers = await gw.log.live_workers(max_age=0)
            draining = sum(await gw.log.workers_draining(workers))
    ready = redis_ok and len(workers) > draining and not gw.shutting_down
    body = {"ready": ready, "redis": redis_ok, "workers": len(workers), "draining": draining}
    return JSONResponse(body, status_code=200 if ready else 503)


def _plugin_routes(gw: Gateway) -> list[BaseRoute]:
    routes: list[BaseRoute] = []
    for mod in pkgutil.iter_modules(gateway.__path__):
        if not mod.name.startswith("api_"):
            continue
        module = importlib.import_module(f"gateway.{mod.name}")
        factory = getattr(module, "routes", None)
        if callable(factory):
            routes.extend(factory(gw))
    return routes


def _page_routes() -> list[BaseRoute]:
    """``/`` and ``/static``: the UI's own routes (gateway/pages.py) when present."""
    try:
        from gateway import pages
    except ImportError:
        pages = None  # type: ignore[assignment]
    if pages is not None and hasattr(pages, "page_routes"):
        return list(pages.page_routes())
    routes: list[BaseRoute] = []
    if (TEMPLATES_DIR / "index.html").is_file():
        from starlette.templating import Jinja2Templates

        templates = Jinja2Templates(directory=str(TEMPLATES_DIR))

        async def index(request: Request) -> Response:
            gw: Gateway = request.app.state.gateway
            ctx: dict[str, Any] = {"model_name": gw.settings.model_name or "default"}
            return templates.TemplateResponse(request, "index.html", ctx)

        routes.append(Route("/", index))
    if STATIC_DIR.is_dir():
        routes.append(Mount("/static", StaticFiles(directory=str(STATIC_DIR)), name="static"))
    return routes


def create_app(settings: Settings, *, extra_routes: Sequence[BaseRoute] = ()) -> Starlette:
    """The gateway application for ``settings``."""
    gw = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    routes: list[BaseRoute] = [
        WebSocketRoute("/v1/ws", websocket_endpoint),
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        *extra_routes,
        *_plugin_routes(gw),
        *_page_routes(),
    ]
    cors = Middleware(CORSMiddleware, policy=gw.guard.origins)
    errors = Middleware(HttpErrorCounter, metrics=gw.metrics)
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[errors, cors])
    app.state.gateway = gw
    return app
