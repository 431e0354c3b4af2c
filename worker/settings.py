"""``tokenrelay worker``'s settings, typed and checked once (from the command line).

The worker loop, its store and its health port read :class:`WorkerSettings`; the
engine's own options become an ``EngineConfig`` (worker/engine_client.py) and a relay's
an ``UpstreamConfig`` (worker/upstream/config.py), each checked where it is built.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
from dataclasses import dataclass, fields

from tokenrelay.core import options
from tokenrelay.core.tracing import check_endpoint
from tokenrelay.core.wire.keys import DEFAULT_PREFIX, worker_dead_after


@dataclass(frozen=True)
class WorkerSettings:
    """What one worker process runs with; ``ValueError`` names the flag of a bad value."""

    redis_url: str
    redis_prefix: str = DEFAULT_PREFIX
    redis_cluster: bool = False
    worker_id: str = ""  # empty: host-pid-random, made here
    detach_timeout: float = options.DETACH_TIMEOUT
    stream_ttl: float = options.STREAM_TTL
    drain_timeout: float = options.DRAIN_TIMEOUT
    otlp_endpoint: str | None = None
    health_port: int = 0  # 0: off
    health_host: str = "127.0.0.1"
    upstream: str | None = None  # a relay to this server (worker/upstream/), no model

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerSettings:
        """The settings the parsed flags of ``worker`` (or ``serve``'s worker) give."""
        if not getattr(args, "redis_url", None):
            raise ValueError("--redis-url is required (or TOKENRELAY_REDIS_URL)")
        worker_dead_after()  # the shared setting: a bad value stops every process at start
        given = {
            f.name: getattr(args, f.name)
            for f in fields(cls)
            if getattr(args, f.name, None) is not None
        }
        return cls(**given)

    def __post_init__(self) -> None:
        if not self.worker_id:
            made = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
            object.__setattr__(self, "worker_id", made)
        if not self.detach_timeout >= 0 or not self.stream_ttl >= 1:
            raise ValueError("--detach-timeout must be >= 0 and --stream-ttl >= 1")
        if not self.drain_timeout >= 0:
            raise ValueError("--drain-timeout must be >= 0")
        if not 0 <= self.health_port < 65536:
            raise ValueError(f"--health-port {self.health_port}: not a TCP port")
        check_endpoint(self.otlp_endpoint)
