"""``tokenrelay gateway``: serve the Starlette app with uvicorn against a shared Redis."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

import uvicorn

from tokenrelay.core.exposure import exposure_error, insecure_banner
from tokenrelay.core.redis.connection import check_cluster_mode
from tokenrelay.gateway.app import Gateway, Settings, create_app
from tokenrelay.gateway.drain import drain
from tokenrelay.gateway.gcpolicy import freeze_startup_heap

if TYPE_CHECKING:
    from tokenrelay.gateway.grpc.server import GrpcServer

log = logging.getLogger("tokenrelay.server")


class GatewayServer(uvicorn.Server):
    """uvicorn, with a drain before shutdown and WebSockets closed with 1001.

    On SIGTERM/SIGINT the gateway first drains (gateway/drain.py: readyz 503,
    new requests refused, a ``notice`` to every socket, attached streams
    finish within ``--drain-timeout``) while still listening. uvicorn's own
    connection shutdown sends 1012; the protocol promises 1001 ("going away"),
    so the gateway closes its sockets itself before that.

    With ``grpc_port`` the gRPC API (gateway/grpc/server.py) starts once uvicorn
    listens, in the same event loop, drains with the WebSockets (a ``shutting_down``
    notice to every call) and ends its calls with ``UNAVAILABLE`` when they close.
    """

    def __init__(
        self, config: uvicorn.Config, gw: Gateway, *, grpc_port: int = 0, grpc_host: str = ""
    ) -> None:
        super().__init__(config)
        self.gw = gw
        self.grpc_port = grpc_port  # 0: no gRPC
        self.grpc_host = grpc_host or config.host
        self.grpc: GrpcServer | None = None
        self.failed: str | None = None  # why the server could not start (exit status 2)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.grpc_port:
            await self._start_grpc()
        if self.started:  # listening, the app started: what exists now lives as long as we do
            freeze_startup_heap()

    async def _start_grpc(self) -> None:
        try:
            from tokenrelay.gateway.grpc.server import (
                GrpcServer,  # grpc loads only with --grpc-port
            )

            self.grpc = GrpcServer(self.gw, self.grpc_host, self.grpc_port)
            await self.grpc.start()
        except ImportError as exc:  # grpcio or the built tokenrelay.v1 is not installed
            self.failed = (
                f"--grpc-port needs the grpc extra (pip install 'tokenrelay[grpc]'): {exc}"
            )
            self.grpc = None
            log.error("the gRPC server could not start", extra={"reason": self.failed[:500]})
            self.should_exit = True
        except (RuntimeError, OSError, ValueError) as exc:
            self.failed = str(exc)
            self.grpc = None
            log.error("the gRPC server could not start", extra={"reason": str(exc)[:500]})
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            gw = self.gw
            gw.shutting_down = True  # readyz 503 from now on
            draining = drain(gw.streams, gw.connections, gw.settings.drain_timeout,
                             force=lambda: self.force_exit)  # fmt: skip
            if self.grpc is None:
                await draining
            else:  # drain() flags the gateway before its first wait; then the calls are told
                await asyncio.gather(draining, self.grpc.drain(self.gw.settings.drain_timeout))
        except Exception:  # never block the shutdown
            log.exception("draining failed")
        for server in self.servers:
            server.close()  # stop accepting first
        try:
            closing = [self.gw.close_connections(wait=2.0)]
            if self.grpc is not None:
                closing.append(self.grpc.stop())
            await asyncio.gather(*closing)
        except Exception:  # never block the shutdown
            log.exception("closing websockets failed")
        await super().shutdown(sockets)


def build_server(
    settings: Settings,
    host: str,
    port: int,
    *,
    log_level: str = "info",
    forwarded_allow_ips: str | None = None,
    grpc_port: int = 0,
) -> GatewayServer:
    """A uvicorn server for the gateway app (not started).

    The client address (per-address limits, logs) comes from ``X-Forwarded-For`` only when
    the connection is from one of ``forwarded_allow_ips`` (default: the settings'), the
    proxies in front of it; gRPC calls follow the settings' (gateway/access/proxies.py).
    ``grpc_port``: serve the gRPC API there too, on ``host`` (0: off).
    """
    if isinstance(grpc_port, bool) or not isinstance(grpc_port, int):
        raise ValueError(f"--grpc-port must be an integer, got {grpc_port!r}")
    if not 0 <= grpc_port <= 65535:
        raise ValueError(f"--grpc-port must be 0 (off) or a port from 1 to 65535, got {grpc_port}")
    if grpc_port and grpc_port == port:
        raise ValueError(f"--grpc-port must differ from --port ({port})")
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
        forwarded_allow_ips=forwarded_allow_ips or settings.forwarded_allow_ips,
    )
    return GatewayServer(config, app.state.gateway, grpc_port=grpc_port, grpc_host=host)


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
    check_cluster_mode(settings.redis_url, settings.redis_cluster)
    server = build_server(
        settings,
        args.host,
        args.port,
        log_level=args.log_level,
        forwarded_allow_ips=args.forwarded_allow_ips,
        grpc_port=getattr(args, "grpc_port", 0) or 0,
    )
    log.info("gateway listening", extra={"host": args.host, "port": args.port})
    bound = getattr(args, "listen_socket", None)  # set by tokenrelay serve
    run_server(server, [bound] if isinstance(bound, socket.socket) else None)
    if server.failed is not None:
        log.error("gateway stopped: %s", server.failed)
        return 2
    return 0
