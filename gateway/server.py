"""``tokenrelay gateway``: serve the Starlette app with uvicorn against a shared Redis."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable

import uvicorn

from core.exposure import exposure_error, insecure_banner
from gateway.app import Gateway, Settings, create_app
from gateway.drain import drain
from gateway.gcpolicy import freeze_startup_heap

log = logging.getLogger("tokenrelay.server")


class GatewayServer(uvicorn.Server):
    """uvicorn, with a drain before shutdown and WebSockets closed with 1001.

    On SIGTERM/SIGINT the gateway first drains (gateway/drain.py: readyz 503,
    new requests refused, a ``notice`` to every socket, attached streams
    finish within ``--drain-timeout``) while still listening. uvicorn's own
    connection shutdown sends 1012; the protocol promises 1001 ("going away"),
    so the gateway closes its sockets itself before that.
    """

    def __init__(self, config: uvicorn.Config, gw: Gateway) -> None:
        super().__init__(config)
        self.gw = gw

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # listening, the app started: what exists now lives as long as we do
            freeze_startup_heap()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await drain(self.gw, self.gw.settings.drain_timeout, force=lambda: self.force_exit)
        except Exception:  # never block the shutdown
            log.exception("draining failed")
        for server in self.servers:
            server.close()  # stop accepting first
        try:
            await self.gw.close_connections(wait=2.0)
        except Exception:  # never block the shutdown
            log.exception("closing websockets failed")
        await super().shutdown(sockets)


def build_server(
    settings: Settings,
    host: str,
    port: int,
    *,
    log_level: str = "info",
    forwarded_allow_ips: str = "127.0.0.1",
) -> GatewayServer:
    """A uvicorn server for the gateway app (not started).

    The client address (per-address limits, logs) comes from ``X-Forwarded-For`` only when
    the connection is from one of ``forwarded_allow_ips``: the proxies in front of it.
    """
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        ws="websockets-sansio",
        ws_max_size=settings.max_frame_bytes,
        ws_ping_interval=settings.heartbeat,
        ws_ping_timeout=settings.heartbeat,
        ws_per_message_deflate=False,
        log_config=None,  # keep tokenrelay's JSON/text logging
        log_level=log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
        proxy_headers=True,
        forwarded_allow_ips=forwarded_allow_ips,
    )
    return GatewayServer(config, app.state.gateway)


def run_server(server: GatewayServer, sockets: list[socket.socket] | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then return normally (callers clean up after).

    ``sockets``: listening sockets bound already (``tokenrelay serve`` binds its port
    before it starts anything else); without them uvicorn binds host and port itself.

    uvicorn re-raises the signal that stopped it once it is done; with the
    default handlers that would kill the process before ``tokenrelay serve``
    could stop its worker and Redis, so quiet handlers are installed first.
    """
    previous = {sig: signal.signal(sig, _note_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(server.serve(sockets))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where installed (cheaper socket writes and timers), else asyncio's.

    ``TOKENRELAY_EVENT_LOOP=asyncio`` forces the standard loop.
    """
    if os.environ.get("TOKENRELAY_EVENT_LOOP", "auto") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _note_signal(signum: int, frame: object) -> None:
    log.debug("signal re-raised by uvicorn after shutdown", extra={"signal": signum})


def main(args: argparse.Namespace) -> int:
    """Entry point of ``tokenrelay gateway``."""
    refused = exposure_error(args)
    if refused is not None:
        log.error(refused)
        return 2
    banner = insecure_banner(args)
    if banner is not None:
        log.warning(banner)
    settings = Settings.from_args(args)
    server = build_server(
        settings,
        args.host,
        args.port,
        log_level=args.log_level,
        forwarded_allow_ips=args.forwarded_allow_ips,
    )
    log.info("gateway listening", extra={"host": args.host, "port": args.port})
    bound = getattr(args, "listen_socket", None)  # set by tokenrelay serve
    run_server(server, [bound] if isinstance(bound, socket.socket) else None)
    return 0
