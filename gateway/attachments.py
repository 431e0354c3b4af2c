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

REFRESH_CHUNK = 250  # attachments refreshed per script call


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
        self._closed = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._refresh(), name="attach-refresh")

    async def close(self) -> None:
        # The flag also ends the loop if the cancel gets lost (seen in Python 3.11 with a
        # cancel arriving inside redis-py's pool wait): then the current sleep ends it.
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def new_id(self) -> str:
        return f"{self.owner}:{secrets.token_hex(4)}"

    async def queue(self, pipe: Any, stream_id: str, attach_id: str) -> None:
        """Add the attachment to a pipeline (call :meth:`track` once it ran)."""
        await self._call([(attach_id, stream_id)], client=pipe)

    def _call(self, items: list[tuple[str, str]], **kw: Any) -> Awaitable[Any]:
        """One script call adding/refreshing ``(attach id, stream id)`` items."""
        keys = [self.keys.attach(sid) for _, sid in items]
        args: list[Any] = [int(ATTACH_TTL * 1000), *(aid for aid, _ in items)]
        return self._script(keys=keys, args=args, **kw)  # type: ignore[no-any-return]

    def track(self, stream_id: str, attach_id: str) -> None:
        self.tracked[attach_id] = stream_id

    async def attach(self, stream_id: str) -> str:
        """Attach a client to the stream now; returns the attachment id."""
        attach_id = self.new_id()
        await self._guard(self._call([(attach_id, stream_id)]))
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
        """Refresh every attachment each ATTACH_REFRESH seconds, a chunk per call.

        Chunks keep both this event loop and Redis free for streaming in between:
        thousands of attachments are a few short script calls, not one long stall.
        """
        while not self._closed:
            await asyncio.sleep(ATTACH_REFRESH)
            if self._closed:
                return
            items = list(self.tracked.items())
            for at in range(0, len(items), REFRESH_CHUNK):
                chunk = [it for it in items[at : at + REFRESH_CHUNK] if it[0] in self.tracked]
                if chunk:  # (one detached meanwhile is not brought back)
                    with contextlib.suppress(RedisUnavailable):
                        await self._guard(self._call(chunk))
