"""The gateway's gRPC server (``--grpc-port``): ``grpc.aio`` in the gateway's own event loop.

:class:`GrpcServer` serves ``tokenrelay.v1.Relay`` (gateway/grpc/service.py), the
standard health service (``grpc.health.v1.Health``) and server reflection
(``grpc.reflection.v1alpha.ServerReflection``) on one port. gateway/server.py starts it
once uvicorn listens and drains and stops it with the WebSockets. Only then is grpc
imported: a gateway without ``--grpc-port`` never loads it.

Health: the service ``""`` is ``SERVING`` while the gateway runs (``/healthz``);
``tokenrelay.v1.Relay`` is ``SERVING`` while it can take a ``Generate`` now (an engine
worker is ready and the gateway is not draining: ``/readyz``). Both turn ``NOT_SERVING``
when the drain starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tokenrelay.gateway.drain import notice_frame
from tokenrelay.gateway.grpc.generated import SERVICE, load
from tokenrelay.gateway.grpc.service import RelayService
from tokenrelay.gateway.observe.readiness import READY

if TYPE_CHECKING:
    from tokenrelay.gateway.state import Gateway

log = logging.getLogger("tokenrelay.grpc")

WATCH_S = 0.5  # how often health statuses and worker_ready notices follow readiness
STOP_GRACE_S = 1.0


def grpc_address(host: str, port: int) -> str:
    """``host:port`` as gRPC takes it (an IPv6 address in brackets)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


class GrpcServer:
    """``tokenrelay.v1.Relay``, health and reflection for one gateway."""

    def __init__(self, gw: Gateway, host: str, port: int) -> None:
        if not 0 < port < 65536:
            raise ValueError(f"--grpc-port must be a port from 1 to 65535, got {port}")
        self.gw = gw
        self.host = host
        self.port = port
        code = load()  # tokenrelay.v1, built with the package (gateway/grpc/generated.py)
        heartbeat_ms = max(1000, int(gw.settings.heartbeat * 1000))
        options = [
            ("grpc.max_receive_message_length", gw.settings.max_frame_bytes),
            ("grpc.keepalive_time_ms", heartbeat_ms),  # as the WebSocket's pings
            ("grpc.keepalive_timeout_ms", heartbeat_ms),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.so_reuseport", 0),  # a port in use is an error, not a shared port
        ]
        self.server = grpc.aio.server(options=options)
        self.service = RelayService(gw, code.pb2)
        code.pb2_grpc.add_RelayServicer_to_server(self.service, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        self._statuses: dict[str, int] = {}
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Listen; returns the port. ``RuntimeError`` when it cannot bind."""
        address = grpc_address(self.host, self.port)
        try:
            bound = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen for gRPC on {address}: {exc}") from None
        if not bound:
            raise RuntimeError(f"cannot listen for gRPC on {address} (in use?)")
        await self.server.start()
        await self._follow()
        self._watch = asyncio.create_task(self._watch_loop(), name="grpc-health")
        log.info("grpc listening", extra={"host": self.host, "port": bound})
        return int(bound)

    async def _follow(self) -> None:
        """Health statuses from readiness; a ``worker_ready`` notice to the calls waiting."""
        gw = self.gw
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        ready = gw.readiness.ready and not gw.shutting_down
        wanted = {"": serving if not gw.shutting_down else not_serving,
                  SERVICE: serving if ready else not_serving}  # fmt: skip
        for name, status in wanted.items():
            if self._statuses.get(name) != status:
                self._statuses[name] = status
                await self.health.set(name, status)
        if gw.readiness.ready:
            waiting = [c for c in self.service.calls if c.waiting_for_worker]
            for call in waiting:
                call.waiting_for_worker = False
                with contextlib.suppress(Exception):  # closing meanwhile, or not reading
                    await asyncio.wait_for(call.send(notice_frame(*READY)), 1.0)

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                await self._follow()
            except Exception:  # never let the watch die
                log.exception("grpc health update failed")

    async def drain(self, timeout: float) -> None:
        """The drain began (gateway/drain.py): health ``NOT_SERVING``, a notice to every call."""
        await self.health.enter_graceful_shutdown()
        frame = notice_frame(
            "shutting_down",
            "the gateway is shutting down: running streams may finish; start new ones elsewhere",
            drain_s=math.ceil(timeout),
        )
        await self.service.notify(frame)

    async def stop(self) -> None:
        """End every call with ``UNAVAILABLE`` (after its queued frames), then stop."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        try:
            await self.service.close_calls()
        finally:
            await self.server.stop(STOP_GRACE_S)
