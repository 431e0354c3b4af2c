"""The live feed: every stream-log append, as published on the ``events`` channel.

Each :data:`core.wire.scripts.APPEND_LUA` call publishes what it wrote, in the
same atomic step as the write, so one subscribed connection per gateway
learns of every new event without reading (or blocking on) thousands of
logs. :class:`LiveFeed` keeps that subscription up: it hands each decoded
message to ``on_batch`` and calls ``on_gap`` whenever messages may have been
lost (the connection dropped, or was only just made, or a message could not be
decoded), so that the tailer falls back to reading the logs until the feed is
trustworthy again. The logs stay the truth; the feed is only the fast path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tokenrelay.core.redis.connection import Backoff, is_outage
from tokenrelay.core.wire.events import Event
from tokenrelay.core.wire.scripts import decode_published

log = logging.getLogger("tokenrelay.livefeed")

# Bytes read from the socket at once: when the gateway is behind, many steps' messages
# are handled before the streams' tasks run, so each sends its events back to back.
READ_SIZE = 1 << 20
# A feed this far behind (seconds, beyond the least lag seen: clock skew) is dropped for
# SHED_PAUSE: the logs are read in batches meanwhile, cheaper per event than the feed
# when a gateway cannot keep up.
SHED_LAG = 0.5
SHED_PAUSE = 2.0


class _Behind(Exception):
    """The feed fell too far behind."""


OnBatch = Callable[[list[tuple[str, int, list[Event]]]], None]


class LiveFeed:
    """One pub/sub subscription to the ``events`` channel, reconnected on failure."""

    def __init__(
        self, url: str, channel: str, on_batch: OnBatch, on_gap: Callable[[], None]
    ) -> None:
        self.channel = channel
        self.up = False  # subscribed now: published events reach on_batch
        self.messages = 0
        self.sheds = 0  # times the feed was dropped for falling behind
        self.appended_at: float | None = None  # the message being handed on: its append time
        self._skew = float("inf")  # the least lag seen on this connection (clock skew)
        self._url = url
        self._on_batch = on_batch
        self._on_gap = on_gap
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="livefeed")

    def watch(self, stream_id: str) -> None:
        """Nothing to do: the one channel carries every stream (shardfeed.py subscribes)."""

    def unwatch(self, stream_id: str) -> None:
        """Nothing to do (see :meth:`watch`)."""

    def covers(self, stream_id: str) -> bool:
        """True while subscribed: every stream's appends arrive."""
        return self.up

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            # bounded: redis-py may swallow the cancel of a read (see core/redis/connection.py)
            await asyncio.wait([self._task], timeout=2.0)

    def _lost(self) -> None:
        self.up = False
        self._on_gap()

    async def _run(self) -> None:
        backoff = Backoff(0.1, 2.0)
        while not self._closed:
            conn = aioredis.Redis.from_url(
                self._url,
                protocol=2,
                socket_connect_timeout=1.0,
                socket_timeout=None,  # a quiet channel is not a failure
                socket_read_size=READ_SIZE,
                retry=Retry(NoBackoff(), 0),
            )
            pubsub = conn.pubsub()
            self._skew = float("inf")
            pause: float | None = None  # after a failure: the backoff's next delay
            try:
                await pubsub.subscribe(self.channel)
                while not self._closed:
                    msg = await pubsub.get_message(timeout=None)
                    if msg is None:
                        continue
                    if msg["type"] == "subscribe":
                        # From here on, nothing published is missed: catch up from the logs.
                        self.up = True
                        backoff.reset()
                        self._on_gap()
                    elif msg["type"] == "message":
                        self.messages += 1
                        self._deliver(msg["data"])
            except asyncio.CancelledError:
                raise
            except _Behind as exc:
                self.sheds += 1
                pause = SHED_PAUSE
                log.warning("live feed %s; reading the logs in batches for a while", exc)
            except Exception as exc:
                if not is_outage(exc):
                    log.exception("live feed failed; reading the logs meanwhile")
            finally:
                self._lost()
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                with contextlib.suppress(Exception):
                    await conn.aclose()
            if not self._closed:
                await asyncio.sleep(backoff.next() if pause is None else pause)

    def _deliver(self, data: bytes) -> None:
        try:
            sent_ms, batch = decode_published(data)
        except (ValueError, TypeError, KeyError):
            log.warning("undecodable live-feed message; reading the logs instead")
            self._on_gap()
            return
        lag = time.time() - sent_ms / 1000
        self._skew = min(self._skew, lag)
        self.appended_at = sent_ms / 1000
        self._on_batch(batch)
        if lag - self._skew > SHED_LAG:
            raise _Behind(f"{lag - self._skew:.1f} s behind")
