"""The state one gateway process shares: its :class:`Settings` and the :class:`Gateway`.

Routes find the :class:`Gateway` on ``request.app.state.gateway`` (gateway/app.py
puts it there): the stream store, the access guard, the metrics and the open
WebSockets.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.runtime import version
from core.wire.keys import DEFAULT_PREFIX
from gateway.access.auth import SecuritySettings
from gateway.access.guard import Guard
from gateway.observe.metrics import GatewayMetrics
from gateway.streams.store import StreamStore
from gateway.ws import protocol as p

if TYPE_CHECKING:
    from gateway.ws.connection import Connection

log = logging.getLogger("tokenrelay.app")


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
    """Process-wide state of one gateway: settings, stream store, open sockets."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.limits = p.Limits(max_tokens=settings.security.max_tokens)
        self.streams = StreamStore(
            settings.redis_url,
            prefix=settings.redis_prefix,
            stream_ttl=settings.stream_ttl,
            detach_timeout=settings.detach_timeout,
            max_pending=settings.max_pending,
        )
        self.guard = Guard(settings.security, self.streams.redis, settings.redis_prefix)
        self.connections: set[Connection] = set()
        self.shutting_down = False
        self.metrics = GatewayMetrics(self)
        self.server_name = f"tokenrelay/{version()}"

    async def start(self) -> None:
        await self.streams.start()
        log.info("gateway started", extra={"gateway_id": self.streams.gateway_id})

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
        await self.streams.close()
