"""The live feed on a Redis Cluster: each stream's own sharded channel (``SSUBSCRIBE``).

On one Redis every append is published on one channel that each gateway reads
whole (gateway/streams/feed.py). On a cluster that channel would carry every token of
every shard through every node, so there each stream publishes on its own channel
``P e:{stream_id}`` with ``SPUBLISH`` (core/wire/scripts.py): the message stays on the
stream's shard, and only gateways tailing that stream hear it.

:class:`ShardedFeed` keeps one pub/sub connection per master that holds a watched
stream, subscribes each watched stream's channel on the master of its slot, and says
which streams it :meth:`covers` (their subscription is confirmed on a live
connection). Whenever a stream's coverage starts or may have had a hole (it was just
confirmed; its connection dropped; its slot moved), ``on_gap`` gets the stream ids, so
the tailer reads their logs once more. The logs stay the truth; the feed is only the
fast path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tokenrelay.core.redis.connection import Backoff, credentials, is_outage
from tokenrelay.core.wire.events import Event
from tokenrelay.core.wire.keys import Keys, slot_of
from tokenrelay.core.wire.scripts import decode_published

log = logging.getLogger("tokenrelay.livefeed")

READ_SIZE = 1 << 20  # as gateway/streams/feed.py

OnBatch = Callable[[list[tuple[str, int, list[Event]]]], None]
OnGap = Callable[[list[str]], None]


class _Link:
    """One master's pub/sub connection and the streams subscribed on it."""

    def __init__(self, name: str, host: str, port: int) -> None:
        self.name, self.host, self.port = name, host, port
        self.pubsub: Any = None  # redis-py PubSub, once connected
        self.conn: aioredis.Redis | None = None
        self.streams: set[str] = set()  # routed here (subscribed, or being subscribed)
        self.confirmed: set[str] = set()  # the server confirmed their subscription
        self.task: asyncio.Task[None] | None = None


class ShardedFeed:
    """Per-stream sharded subscriptions over one connection per master."""

    def __init__(
        self, url: str, cluster: RedisCluster, keys: Keys, on_batch: OnBatch, on_gap: OnGap
    ) -> None:
        self.up = True  # the tailer reads lagging streams only (see covers())
        self.messages = 0
        self.sheds = 0  # never: a stream's messages reach only its gateways
        self.appended_at: float | None = None
        self._cluster = cluster
        self._keys = keys
        self._on_batch = on_batch
        self._on_gap = on_gap
        self._credentials = credentials(url)
        self._watched: set[str] = set()
        self._links: dict[str, _Link] = {}
        self._routes: dict[str, _Link] = {}  # stream id -> its link
        self._closed = False
        self._started = False

    def start(self) -> None:
        self._started = True
        for sid in list(self._watched):
            self._route(sid)

    async def close(self) -> None:
        self._closed = True
        tasks = [link.task for link in self._links.values() if link.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:  # bounded: redis-py may swallow the cancel of a read
            await asyncio.wait(tasks, timeout=2.0)

    def covers(self, stream_id: str) -> bool:
        """True while the stream's channel is subscribed on a live connection."""
        link = self._routes.get(stream_id)
        return link is not None and stream_id in link.confirmed

    def watch(self, stream_id: str) -> None:
        """Subscribe the stream's channel (``on_gap`` names it once confirmed)."""
        if stream_id in self._watched:
            return
        self._watched.add(stream_id)
        if self._started and not self._closed:
            self._route(stream_id)

    def unwatch(self, stream_id: str) -> None:
        """Drop the stream's subscription."""
        self._watched.discard(stream_id)
        link = self._routes.pop(stream_id, None)
        if link is None:
            return
        link.streams.discard(stream_id)
        if stream_id in link.confirmed:
            link.confirmed.discard(stream_id)
            self._send(link, "sunsubscribe", stream_id)

    # --- routing ---------------------------------------------------------------------

    def _route(self, stream_id: str) -> None:
        """Put the stream on the link of its slot's master, starting that link if need be."""
        try:
            node = self._cluster.nodes_manager.get_node_from_slot(
                slot_of(self._keys.channel(stream_id))
            )
        except Exception:  # no slot map yet: a link refreshes it and routes again
            node = None
        if node is None:
            self._ensure_link("?", "", 0)  # a placeholder link that only refreshes the map
            self._links["?"].streams.add(stream_id)
            self._routes[stream_id] = self._links["?"]
            return
        link = self._ensure_link(node.name, node.host, int(node.port))
        link.streams.add(stream_id)
        self._routes[stream_id] = link
        if link.pubsub is not None:
            self._send(link, "ssubscribe", stream_id)

    def _ensure_link(self, name: str, host: str, port: int) -> _Link:
        link = self._links.get(name)
        if link is None:
            link = self._links[name] = _Link(name, host, port)
            link.task = asyncio.get_running_loop().create_task(
                self._run(link), name=f"shardfeed-{name}"
            )
        return link

    def _send(self, link: _Link, command: str, stream_id: str) -> None:
        """Send (un)subscribe for the stream on the link; a failure drops the link."""

        async def send() -> None:
            try:
                await getattr(link.pubsub, command)(self._keys.channel(stream_id))
            except Exception:
                if link.task is not None:  # the reader sees the broken connection too
                    link.task.cancel()

        asyncio.get_running_loop().create_task(send())

    async def _reroute(self, link: _Link) -> None:
        """After a failure: refresh the slot map and route the link's streams again."""
        with contextlib.suppress(Exception):
            await self._cluster.nodes_manager.initialize()
        if self._links.get(link.name) is link:
            del self._links[link.name]
        for sid in list(link.streams):
            if self._routes.get(sid) is link and sid in self._watched:
                del self._routes[sid]
                self._route(sid)

    # --- one link ----------------------------------------------------------------------

    async def _run(self, link: _Link) -> None:
        backoff = Backoff(0.1, 2.0)
        while not self._closed and link.streams:
            if link.name == "?":
                await asyncio.sleep(backoff.next())
                await self._reroute(link)
                return
            try:
                await self._serve(link)
            except asyncio.CancelledError:
                if self._closed:
                    raise
            except Exception as exc:
                if not is_outage(exc):
                    log.warning("sharded feed link %s failed: %r", link.name, exc)
            finally:
                lost = sorted(link.confirmed)
                link.confirmed.clear()
                link.pubsub = None
                if link.conn is not None:
                    with contextlib.suppress(Exception):
                        await link.conn.aclose()
                    link.conn = None
                if lost:
                    self._on_gap(lost)
            if self._closed:
                return
            await asyncio.sleep(backoff.next())
            await self._reroute(link)  # the slot may have moved, or the master failed over
            return
        if self._links.get(link.name) is link:
            del self._links[link.name]

    async def _serve(self, link: _Link) -> None:
        link.conn = aioredis.Redis(
            host=link.host,
            port=link.port,
            protocol=2,
            socket_connect_timeout=1.0,
            socket_timeout=None,  # a quiet channel is not a failure
            socket_read_size=READ_SIZE,
            retry=Retry(NoBackoff(), 0),
            **self._credentials,
        )
        pubsub = link.conn.pubsub()
        await pubsub.connect()
        link.pubsub = pubsub
        for sid in sorted(link.streams):
            await pubsub.ssubscribe(self._keys.channel(sid))
        prefix_len = len(self._keys.channel(""))  # "P e:{" + "}" around the id
        while not self._closed:
            msg = await pubsub.get_message(timeout=None)
            if msg is None:
                continue
            channel = msg["channel"]
            name = channel.decode() if isinstance(channel, bytes) else str(channel)
            sid = name[prefix_len - 1 : -1]
            kind = msg["type"]
            if kind == "smessage":
                self.messages += 1
                self._deliver(sid, msg["data"])
            elif kind == "ssubscribe":
                if sid in link.streams and sid in self._watched:
                    link.confirmed.add(sid)
                    self._on_gap([sid])  # from here on nothing is missed: read its log once
            elif kind == "sunsubscribe" and sid in link.streams and sid in self._watched:
                # the server dropped it (its slot moved): route it again
                link.confirmed.discard(sid)
                link.streams.discard(sid)
                self._routes.pop(sid, None)
                self._on_gap([sid])
                with contextlib.suppress(Exception):
                    await self._cluster.nodes_manager.initialize()
                self._route(sid)

    def _deliver(self, stream_id: str, data: bytes) -> None:
        try:
            sent_ms, batch = decode_published(data)
        except (ValueError, TypeError, KeyError):
            log.warning("undecodable live-feed message; reading the log instead")
            self._on_gap([stream_id])
            return
        self.appended_at = sent_ms / 1000
        lag = time.time() - self.appended_at
        if lag > 60:  # a clock far off: no delivery latency from it
            self.appended_at = None
        self._on_batch(batch)
