"""The client's sockets: one primary for new streams, reopened with backoff when lost.

:meth:`Pool.get` returns the primary :class:`Connection` (client/connection.py), opening
one when there is none, the last one is gone, or its gateway drains (docs/protocol.md,
"`notice`": a client may open its next socket as soon as it sees ``shutting_down``; the
draining one keeps delivering its streams until the gateway closes it). Opening waits a
jittered exponential backoff after each failure in a row, and after each socket that
closed without having delivered anything; after ``RetryPolicy.limit`` failures in a row
it raises :class:`ConnectionFailed`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping

from tokenrelay.client.connection import Connection, Unreachable, open_connection
from tokenrelay.client.errors import ConnectionFailed
from tokenrelay.client.retry import RetryPolicy

__all__ = ["Pool"]


class Pool:
    """The sockets of one client to one gateway URL (see the module)."""

    def __init__(
        self,
        url: str,
        headers: Mapping[str, str],
        policy: RetryPolicy,
        *,
        open_timeout: float = 10.0,
        max_size: int | None = None,
    ) -> None:
        self.url = url
        self.headers = dict(headers)
        self.policy = policy
        self.open_timeout = open_timeout
        self.max_size = max_size
        self.connects = 0  # sockets opened, the first included
        self.drains = 0  # sockets whose gateway announced a drain
        self._primary: Connection | None = None
        self._open: set[Connection] = set()
        self._failures = 0  # attempts in a row that gave nothing (the backoff's exponent)
        self._lock = asyncio.Lock()
        self._closed = False
        self._ready = asyncio.Event()  # the last word of a gateway: an engine worker is ready

    @property
    def primary(self) -> Connection | None:
        """The socket new streams go to, if one is open."""
        return self._primary

    async def get(self) -> Connection:
        """The primary socket, opened (with backoff) when needed."""
        async with self._lock:
            while True:
                if self._closed:
                    raise RuntimeError("the client is closed")
                conn = self._primary
                if conn is not None and conn.usable:
                    return conn
                if conn is not None:
                    if conn.draining:  # announced: a new socket now, no waiting
                        self.drains += 1
                        self._failures = 0
                    else:
                        self._failures = 1 if conn.useful else self._failures + 1
                    self._primary = None
                if self._failures > self.policy.limit:
                    failures, self._failures = self._failures, 0
                    raise ConnectionFailed(f"no connection to {self.url} after {failures} attempts")
                if self._failures:
                    await asyncio.sleep(self.policy.backoff(self._failures - 1))
                try:
                    conn = await open_connection(self.url, self.headers,
                                                 open_timeout=self.open_timeout,
                                                 max_size=self.max_size)  # fmt: skip
                except Unreachable:
                    self._failures += 1
                    continue
                self.connects += 1
                conn.on_close = self._open.discard
                conn.on_ready = self._ready.set
                if conn.hello.worker_ready:
                    self._ready.set()
                else:
                    self._ready.clear()
                self._open.add(conn)
                self._primary = conn
                return conn

    async def wait_ready(self, timeout: float) -> None:
        """Wait ``timeout`` seconds, or less if a gateway says an engine worker is ready
        (a ``worker_ready`` notice, on a socket whose ``hello`` said none was)."""
        self._ready.clear()  # a refusal said there is none: wait for news
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._ready.wait()

    async def close(self) -> None:
        """Close every socket (their streams are detached: the gateway keeps generating
        them for its detach timeout)."""
        self._closed = True
        conns = list(self._open)
        self._open.clear()
        self._primary = None
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
