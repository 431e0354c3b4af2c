"""Which clients are attached to which streams, as engine workers see it.

A client that started or resumed a stream is *attached* until its socket (or
SSE response) goes away. Workers only abort a stream for the detach timeout
when it has had no attachment for that long, so a gateway keeps each of its
attachments alive in Redis (a sorted-set member whose score is an expiry in
Redis server time, refreshed every :data:`ATTACH_REFRESH` seconds) and removes
it on detach. If the gateway dies, its attachments lapse on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from gateway.schema import ATTACH_LUA, ATTACH_REFRESH, ATTACH_TTL, Keys
from gateway.tailer import RedisUnavailable

Guard = Callable[[Awaitable[Any]], Awaitable[Any]]


class Attachments:
    """This gateway's attachments, kept alive until detached."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, owner: str, guard: Guard) -> None:
        self.redis = redis
        self.keys = keys
        self.owner = owner
        self._guard = guard
        self._script = redis.register_script(ATTACH_LUA)
        self.tracked: dict[str, str] = {}  # attach id -> stream id
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._refresh(), name="attach-refresh")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def new_id(self) -> str:
        return f"{self.owner}:{secrets.token_hex(4)}"

    async def queue(self, pipe: Any, stream_id: str, attach_id: str) -> None:
        """Add the attachment to a pipeline (call :meth:`track` once it ran)."""
        args: list[Any] = [attach_id, int(ATTACH_TTL * 1000)]
        await self._script(keys=[self.keys.attach(stream_id)], args=args, client=pipe)

    def track(self, stream_id: str, attach_id: str) -> None:
        self.tracked[attach_id] = stream_id

    async def attach(self, stream_id: str) -> str:
        """Attach a client to the stream now; returns the attachment id."""
        attach_id = self.new_id()
        args: list[Any] = [attach_id, int(ATTACH_TTL * 1000)]
        await self._guard(self._script(keys=[self.keys.attach(stream_id)], args=args))
        self.track(stream_id, attach_id)
        return attach_id

    async def detach(self, stream_id: str, attach_id: str | None) -> None:
        """Drop an attachment (best effort: it lapses on its own anyway)."""
        if attach_id is None:
            return
        self.tracked.pop(attach_id, None)
        with contextlib.suppress(RedisUnavailable):
            await self._guard(self.redis.zrem(self.keys.attach(stream_id), attach_id))

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(ATTACH_REFRESH)
            items = list(self.tracked.items())
            if not items:
                continue
            pipe = self.redis.pipeline(transaction=False)
            for attach_id, sid in items:
                await self.queue(pipe, sid, attach_id)
            with contextlib.suppress(RedisUnavailable):
                await self._guard(pipe.execute())
