"""Which clients are attached to which streams, as engine workers see it.

A client that started or resumed a stream is *attached* until its socket (or
SSE response) goes away. Workers only abort a stream for the detach timeout
when it has had no attachment for that long, so a gateway keeps each of its
attachments alive in Redis (a sorted-set member whose score is an expiry in
Redis server time, refreshed every :data:`ATTACH_REFRESH` seconds) and removes
it on detach. If the gateway dies, its attachments lapse on their own.

Detaches are coalesced: the ones that arrive together (a burst of disconnects,
a load balancer dropping every socket) go to Redis as a few script calls of
:data:`DETACH_CHUNK` instead of two commands each. One at a time, a detach is
still one round trip.

On a Redis Cluster a script call's keys must share a slot, so there each stream is a
call of its own; the calls of a refresh or a detach burst still go as one pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from tokenrelay.core.redis.connection import is_cluster, queue_script
from tokenrelay.core.wire.keys import ATTACH_REFRESH, ATTACH_TTL, Keys
from tokenrelay.core.wire.scripts import ATTACH_LUA, DETACH_LUA
from tokenrelay.core.wire.telemetry import DISCONNECTS_FIELD
from tokenrelay.gateway.errors import RedisFull, RedisUnavailable

log = logging.getLogger("tokenrelay.gateway")

Guard = Callable[[Awaitable[Any]], Awaitable[Any]]

REFRESH_CHUNK = 250  # attachments refreshed per script call
DETACH_CHUNK = 250  # detaches per script call


class Attachments:
    """This gateway's attachments, kept alive until detached."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, owner: str, guard: Guard) -> None:
        self.redis = redis
        self.keys = keys
        self.owner = owner
        self._guard = guard
        self._cluster = is_cluster(redis)
        self._script = redis.register_script(ATTACH_LUA)
        self._detach_script = redis.register_script(DETACH_LUA)
        self.tracked: dict[str, str] = {}  # attach id -> stream id
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        # (stream id, attach id, its caller's answer) waiting for the next detach call
        self._detaching: list[tuple[str, str, asyncio.Future[bool]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.detach_calls = 0  # script calls made for detaches (tests, debugging)

    def start(self) -> None:
        self._task = asyncio.create_task(self._refresh(), name="attach-refresh")

    async def close(self) -> None:
        # The flag also ends the loop if the cancel gets lost (seen in Python 3.11 with a
        # cancel arriving inside redis-py's pool wait): then the current sleep ends it.
        self._closed = True
        flusher = self._flusher
        if flusher is not None and not flusher.done():  # let queued detaches reach Redis
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(flusher), 2.0)
            flusher.cancel()
        for _, _, answer in self._detaching:
            if not answer.done():
                answer.set_result(False)
        self._detaching.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def new_id(self) -> str:
        return f"{self.owner}:{secrets.token_hex(4)}"

    def queue(self, pipe: Any, stream_id: str, attach_id: str) -> None:
        """Add the attachment to a pipeline (call :meth:`track` once it ran)."""
        queue_script(pipe, ATTACH_LUA, *self._keys_args([(attach_id, stream_id)]))

    def _keys_args(self, items: list[tuple[str, str]]) -> tuple[list[str], list[Any]]:
        keys = [self.keys.attach(sid) for _, sid in items]
        return keys, [int(ATTACH_TTL * 1000), *(aid for aid, _ in items)]

    def _call(self, items: list[tuple[str, str]]) -> Awaitable[Any]:
        """One script call adding/refreshing ``(attach id, stream id)`` items (one
        pipeline of a call per item on a cluster)."""
        if self._cluster and len(items) > 1:
            return self._each(ATTACH_LUA, [self._keys_args([it]) for it in items])
        keys, args = self._keys_args(items)
        return self._script(keys=keys, args=args)  # type: ignore[no-any-return]

    async def _each(self, script: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """Replies of one pipeline of ``script`` calls (a cluster: one stream each). A shard
        that does not answer costs only its own calls (their replies are the errors), unless
        none answered: then the first error is raised."""
        pipe = self.redis.pipeline(transaction=False)
        for keys, args in calls:
            queue_script(pipe, script, keys, args)
        replies = list(await pipe.execute(raise_on_error=False))
        errors = [r for r in replies if isinstance(r, Exception)]
        if errors and len(errors) == len(replies):
            raise errors[0]
        return replies

    def track(self, stream_id: str, attach_id: str) -> None:
        self.tracked[attach_id] = stream_id

    async def attach(self, stream_id: str) -> str:
        """Attach a client to the stream now; returns the attachment id.

        A full Redis (maxmemory) refuses the write, not the resume: the attachment is
        kept here and reaches Redis with the next refresh that finds room.
        """
        attach_id = self.new_id()
        with contextlib.suppress(RedisFull):
            await self._guard(self._call([(attach_id, stream_id)]))
        self.track(stream_id, attach_id)
        return attach_id

    async def detach(self, stream_id: str, attach_id: str | None) -> bool:
        """Drop an attachment; True when its stream was not done yet (a disconnect).

        Best effort: an attachment Redis did not hear about lapses on its own, and
        the answer is then False. Coalesced with the detaches arriving meanwhile.
        """
        if attach_id is None:
            return False
        self.tracked.pop(attach_id, None)
        if self._closed:
            return False
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._detaching.append((stream_id, attach_id, answer))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_detaches(), name="detach-flush")
        return await asyncio.shield(answer)  # a cancelled caller leaves the batch intact

    async def _flush_detaches(self) -> None:
        await asyncio.sleep(0)  # the detaches of this pass of the loop join the first call
        while self._detaching:
            batch = self._detaching[:DETACH_CHUNK]
            del self._detaching[:DETACH_CHUNK]
            calls = [
                ([self.keys.attach(sid), self.keys.meta(sid)], [DISCONNECTS_FIELD, aid])
                for sid, aid, _ in batch
            ]
            keys = [k for ks, _ in calls for k in ks]
            args = [DISCONNECTS_FIELD, *(aid for _, aid, _ in batch)]
            counted: list[Any] = []
            try:
                self.detach_calls += 1
                if self._cluster and len(batch) > 1:
                    replies = await self._guard(self._each(DETACH_LUA, calls))
                    counted = [0 if isinstance(r, Exception) else r[0] for r in replies]
                else:
                    counted = list(await self._guard(self._detach_script(keys=keys, args=args)))
            except RedisUnavailable:
                pass
            except Exception:  # best effort
                sids = [sid for sid, _, _ in batch[:5]]
                log.exception("detach failed", extra={"streams": len(batch), "stream_ids": sids})
            finally:  # answered whatever happened, cancellation included: nobody waits forever
                for i, (_, _, answer) in enumerate(batch):
                    if not answer.done():
                        answer.set_result(i < len(counted) and int(counted[i]) == 1)

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
