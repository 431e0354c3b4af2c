"""The state one gateway process shares: its :class:`Settings` and the :class:`Gateway`.

Routes find the :class:`Gateway` on ``request.app.state.gateway`` (gateway/app.py
puts it there): the stream store, the access guard, the resumes reading each stream,
the metrics and the open WebSockets.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from tokenrelay.core import options
from tokenrelay.core.runtime import version
from tokenrelay.core.tracing import (
    DEFAULT_CLIENT_TRACE,
    GATEWAY_SERVICE,
    check_client_trace,
    check_endpoint,
    start_tracing,
)
from tokenrelay.core.wire.keys import DEFAULT_PREFIX, worker_dead_after
from tokenrelay.gateway.access.auth import SecuritySettings
from tokenrelay.gateway.access.guard import Guard
from tokenrelay.gateway.access.proxies import TrustedProxies
from tokenrelay.gateway.drain import ClientSocket
from tokenrelay.gateway.observe.metrics import GatewayMetrics
from tokenrelay.gateway.observe.readiness import ReadinessWatch
from tokenrelay.gateway.session import protocol as p
from tokenrelay.gateway.session.stream_session import SessionParts
from tokenrelay.gateway.streams.readers import StreamReaders
from tokenrelay.gateway.streams.routing import ModelDirectory
from tokenrelay.gateway.streams.store import StreamStore

log = logging.getLogger("tokenrelay.app")


@dataclass
class Settings:
    """Gateway settings (from the command line / environment)."""

    redis_url: str
    redis_prefix: str = DEFAULT_PREFIX
    redis_cluster: bool = False
    heartbeat: float = options.HEARTBEAT
    max_frame_bytes: int = options.MAX_FRAME_BYTES
    detach_timeout: float = options.DETACH_TIMEOUT
    max_detach_timeout: float = options.MAX_DETACH_TIMEOUT  # a request's detach_timeout
    stream_ttl: float = options.STREAM_TTL
    max_connections: int = options.MAX_CONNECTIONS
    max_streams_per_connection: int = options.MAX_STREAMS_PER_CONNECTION
    max_resumes_per_stream: int = options.MAX_RESUMES_PER_STREAM
    max_pending: int = options.MAX_PENDING
    send_queue: int = 256
    model_name: str | None = None
    drain_timeout: float = options.DRAIN_TIMEOUT
    http_max_streams_per_client: int = options.HTTP_MAX_STREAMS_PER_CLIENT
    sse_keepalive: float = options.SSE_KEEPALIVE
    security: SecuritySettings = field(default_factory=SecuritySettings)
    otlp_endpoint: str | None = None  # traces (core/tracing.py); None: off
    client_traceparent: str = DEFAULT_CLIENT_TRACE  # follow, link or ignore (core/tracing.py)
    forwarded_allow_ips: str = "127.0.0.1"  # the proxies believed (gateway/access/proxies.py)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        """The settings the parsed flags of ``gateway`` or ``serve`` give (core/options.py)."""
        if not args.redis_url:
            raise ValueError("--redis-url is required (or TOKENRELAY_REDIS_URL)")
        worker_dead_after()  # the shared setting: a bad value stops every process at start
        given = {
            f.name: getattr(args, f.name)
            for f in fields(cls)
            if f.name != "security" and getattr(args, f.name, None) is not None
        }
        return cls(**given, security=SecuritySettings.from_args(args))

    def __post_init__(self) -> None:
        if self.heartbeat <= 0:
            raise ValueError("--heartbeat must be > 0")
        if self.max_frame_bytes < 1024:
            raise ValueError("--max-frame-bytes must be >= 1024")
        if self.detach_timeout < 0 or self.stream_ttl < 1:
            raise ValueError("--detach-timeout must be >= 0 and --stream-ttl >= 1")
        most = self.max_detach_timeout
        if not 0 < most < math.inf or most < self.detach_timeout:
            raise ValueError(
                f"--max-detach-timeout must be a finite number > 0 and >= "
                f"--detach-timeout ({self.detach_timeout:g}), got {most:g}"
            )
        if not self.drain_timeout >= 0:
            raise ValueError("--drain-timeout must be >= 0")
        n = self.max_resumes_per_stream
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"--max-resumes-per-stream must be an integer >= 1, got {n!r}")
        if self.http_max_streams_per_client < 1 or not self.sse_keepalive > 0:
            raise ValueError("--http-max-streams-per-client must be >= 1, --sse-keepalive > 0")
        check_endpoint(self.otlp_endpoint)
        check_client_trace(self.client_traceparent)
        TrustedProxies(self.forwarded_allow_ips)


class Gateway:
    """Process-wide state of one gateway: settings, stream store, open sockets."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.base_limits = p.Limits(
            max_tokens=settings.security.max_tokens,
            max_output_entries=settings.security.max_output_entries,
            max_detach_timeout=settings.max_detach_timeout,
        )
        self.limits = self.base_limits  # bounded by the model's context once a worker says it
        self.streams = StreamStore(
            settings.redis_url,
            prefix=settings.redis_prefix,
            cluster=settings.redis_cluster,
            stream_ttl=settings.stream_ttl,
            detach_timeout=settings.detach_timeout,
            max_pending=settings.max_pending,
        )
        self.streams.client_trace = check_client_trace(settings.client_traceparent)
        self.streams.ledger.limit = settings.security.max_log_bytes  # --max-log-bytes-per-key
        if settings.otlp_endpoint:  # else nothing of OpenTelemetry is imported
            self.streams.tracing = start_tracing(
                settings.otlp_endpoint, GATEWAY_SERVICE, self.streams.gateway_id
            )
        self.models = ModelDirectory(self.streams, settings.model_name)  # who serves what
        self.guard = Guard(settings.security, self.streams.draw_tokens)
        self.connections: set[ClientSocket] = set()  # the open WebSockets
        self.calls: set[Any] = set()  # the open gRPC calls (gateway/grpc/service.py)
        self.proxies = TrustedProxies(settings.forwarded_allow_ips)  # gRPC's client addresses
        self.readers = StreamReaders(settings.max_resumes_per_stream)  # resumes per stream
        self.session_parts = SessionParts(
            self.streams,
            self.guard,
            self.models,
            settings.max_streams_per_connection,
            self.readers,
        )
        self.shutting_down = False
        self.metrics = GatewayMetrics(self.streams, self.connections, lambda: self.shutting_down)
        self.server_name = f"tokenrelay/{version()}"
        # is a worker ready? (hello, notices); the workers bound request sizes
        self.readiness = ReadinessWatch(self.streams, self.connections, self.follow_context)

    def open_connections(self) -> int:
        """WebSockets and gRPC calls open now: what ``--max-connections`` bounds."""
        return len(self.connections) + len(self.calls)

    async def hello(self) -> dict[str, Any]:
        """The ``hello`` frame a new WebSocket gets (docs/protocol.md)."""
        if not self.readiness.ready:  # a worker may have come up within the last second
            await self.readiness.check(fresh=True)
        return p.hello_frame(
            self.settings.heartbeat,
            max_frame_bytes=self.settings.max_frame_bytes,
            server=self.server_name,
            worker_ready=self.readiness.ready,
            detach=(self.settings.detach_timeout, self.settings.max_detach_timeout),
        )

    def follow_context(
        self, context_tokens: int | None, vocab_size: int | None = None,
        text_only: bool | None = None,
    ) -> None:  # fmt: skip
        """Bound request sizes by the served model's context (``None``: keep the last bound),
        token ids (``logit_bias``, ``stop_token_ids``) by its vocabulary, and refuse image
        parts while ``text_only`` (every worker runs our engine; ``None``: as it was).

        Workers that come and go keep the last known bound: a gateway without a live
        worker refuses the too-long input rather than queueing it.
        """
        if vocab_size is not None and vocab_size != self.limits.vocab_size:
            self.limits = replace(self.limits, vocab_size=vocab_size)
        if context_tokens is not None and context_tokens != self.limits.context_tokens:
            vocab = self.limits.vocab_size
            self.limits = replace(self.base_limits.for_context(context_tokens), vocab_size=vocab)
            log.info(
                "request size follows the model's context",
                extra={
                    "context_tokens": context_tokens,
                    "max_input_chars": self.limits.max_input_chars,
                },
            )
        if text_only is not None and text_only != self.limits.text_only:
            self.limits = replace(self.limits, text_only=text_only)
            self.base_limits = replace(self.base_limits, text_only=text_only)

    async def start(self) -> None:
        await self.streams.start()
        await self.readiness.check()
        self.readiness.start()
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
        await self.readiness.stop()
        await self.close_connections()
        await self.streams.close()
        if self.streams.tracing is not None:
            # exports the spans still held (blocking HTTP: off the loop)
            await asyncio.to_thread(self.streams.tracing.shutdown)
