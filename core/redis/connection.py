"""Redis clients with tokenrelay's settings, and quiet outage reporting.

Both the gateway (asyncio) and the engine worker (threads) talk to Redis
through clients made here: RESP2 replies, short connect timeouts and a single
quick retry, so an outage surfaces in well under a second instead of after
redis-py's default ten retries. :class:`RedisHealth` logs one line when Redis
goes away and one when it is back, however many calls fail in between.

With ``cluster=True`` (``--redis-cluster``) the clients are redis-py's cluster clients:
they route each command by its key's hash slot (core/wire/keys.py tags every key of a
stream alike), follow ``MOVED``/``ASK`` and refresh the slot map after a failure. A shard
whose master is down is an outage like any other, for the streams on that shard only.

A Redis at its ``maxmemory`` (``noeviction``: the embedded one, core/redis/embedded.py)
refuses writes with ``OOM`` but still answers reads: :func:`is_full` tells that apart,
and :func:`is_outage` counts it as an outage, so every caller that waits out an outage
(the worker keeps its events and writes them again) waits out a full Redis too.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ConstantBackoff
from redis.retry import Retry

from tokenrelay.core.wire.keys import slot_of

log = logging.getLogger("tokenrelay.redis")

# Errors that mean "Redis is not reachable right now" (as opposed to a bug).
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.BusyLoadingError,
    redis.exceptions.ClusterError,  # CLUSTERDOWN, MASTERDOWN: a shard has no master
    redis.exceptions.SlotNotCoveredError,  # no node serves the key's slot
    redis.exceptions.TryAgainError,
    # redis-py >= 8: no startup node of a cluster answered a topology refresh
    *[e for e in [getattr(redis.exceptions, "RedisClusterUnreachableError", None)] if e],
    ConnectionError,
    OSError,
)
# What Redis says when it refuses a write at maxmemory (after its "OOM" error code).
OOM_MESSAGE = "command not allowed when used memory > 'maxmemory'"


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs): ``redis://:***@host:6379/0``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def credentials(url: str) -> dict[str, Any]:
    """``username``, ``password`` and ``ssl`` of ``url``: what a client of one node of a
    cluster (a pub/sub connection to a given master) needs besides its host and port."""
    parts = urlsplit(url)
    return {
        "username": unquote(parts.username) if parts.username else None,
        "password": unquote(parts.password) if parts.password else None,
        "ssl": parts.scheme == "rediss",
    }


def is_full(exc: BaseException) -> bool:
    """True when Redis refused a write because it is at ``maxmemory`` (``OOM``).

    A plain command raises ``OutOfMemoryError``; a write inside a Lua script comes
    back (Redis 6) as a ``ResponseError`` whose text carries Redis' ``OOM`` message.
    """
    if isinstance(exc, redis.OutOfMemoryError):
        return True
    return isinstance(exc, redis.ResponseError) and OOM_MESSAGE in str(exc)


def is_outage(exc: BaseException) -> bool:
    """True for errors that mean Redis is down, restarting, still loading or full."""
    if isinstance(exc, OUTAGE_ERRORS):
        return True
    if isinstance(exc, redis.ResponseError):
        msg = str(exc)
        outage = ("LOADING", "READONLY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN")
        return msg.startswith(outage) or is_full(exc)
    return False


def queue_script(pipe: Any, script: str, keys: list[str], args: list[Any]) -> None:
    """Queue a Lua ``script`` on a pipeline as ``EVAL`` (its text, not its SHA).

    A pipeline holding a registered ``Script`` costs a round trip more: redis-py first
    sends ``SCRIPT EXISTS`` on its own, in case a restarted Redis lost its script cache.
    ``EVAL`` carries the text, so the pipeline stays one round trip and can never meet
    ``NOSCRIPT``; Redis still compiles the script once and finds it again by its SHA.
    An engine step's append is such a pipeline (bench/redis_append.py measures it).
    On a cluster pipeline the call names its node (the master of its first key's slot,
    as the client's slot map has it): redis-py would otherwise ask Redis for the keys of
    every ``EVAL`` (``COMMAND GETKEYS``), a round trip per call before the pipeline is
    sent. A slot that moved meanwhile answers ``MOVED``, which the pipeline follows.
    """
    # execute_command, not eval(): redis-py's blocking cluster pipeline refuses eval()
    route = routed(pipe, keys[0]) if keys else {}
    pipe.execute_command("EVAL", script, len(keys), *keys, *args, **route)


def routed(client: Any, key: str) -> dict[str, Any]:
    """``target_nodes=`` for a command on ``key`` by a cluster client or pipeline: the
    master of its slot, as the client's slot map has it ({} for a plain client).

    redis-py finds the keys of a command whose keys move (``EVAL``, ``XREAD``,
    ``XREADGROUP``) by asking Redis (``COMMAND GETKEYS``), one round trip per command,
    before it sends a pipeline; a command that names its node skips that. A slot that
    moved meanwhile answers ``MOVED``, which redis-py follows.
    """
    if not is_cluster(client):
        return {}
    return {"target_nodes": client.nodes_manager.get_node_from_slot(slot_of(key))}


def xread_one(client: Any, key: str, after: str, count: int, block: int | None = None) -> Any:
    """``XREAD`` of one stream (sent, or queued on a pipeline), routed (:func:`routed`)."""
    blocking = ("BLOCK", block) if block is not None else ()
    args = ("XREAD", "COUNT", count, *blocking, "STREAMS", key, after)
    return client.execute_command(*args, **routed(client, key))


def xreadgroup_one(
    client: Any, group: str, consumer: str, key: str, after: str, count: int, block: int | None
) -> Any:
    """``XREADGROUP`` of one stream (sent, or queued on a pipeline), routed (:func:`routed`)."""
    blocking = ("BLOCK", block) if block is not None else ()
    args = ("XREADGROUP", "GROUP", group, consumer, "COUNT", count, *blocking)
    return client.execute_command(*args, "STREAMS", key, after, **routed(client, key))


def _retry() -> Retry:
    return Retry(ConstantBackoff(0.05), retries=1)


def check_cluster_mode(url: str, cluster: bool) -> None:
    """Raise ``ValueError`` when ``--redis-cluster`` and what ``url`` serves disagree.

    Either way round the process would only fail later, key by key (``MOVED`` from a
    cluster node; no slot map from a plain Redis). A Redis that does not answer yet, or
    refuses ``INFO``, passes: the outage handling waits for it as for any other.
    """
    client = redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=2.0)
    try:
        enabled = str(client.info("cluster").get("cluster_enabled", 0)) == "1"
    except redis.RedisError:
        return
    finally:
        client.close()
    if cluster and not enabled:
        raise ValueError(
            f"--redis-cluster: {redact_url(url)} is not a Redis Cluster node "
            "(cluster_enabled:0); drop --redis-cluster or point --redis-url at a cluster node"
        )
    if enabled and not cluster:
        raise ValueError(
            f"{redact_url(url)} is a Redis Cluster node: add --redis-cluster "
            "(TOKENRELAY_REDIS_CLUSTER=1) to every gateway and worker"
        )


def is_cluster(client: Any) -> bool:
    """True for a Redis Cluster client (sync or asyncio), a pipeline of one included."""
    return isinstance(
        client,
        redis.cluster.RedisCluster
        | redis.cluster.ClusterPipeline
        | aiocluster.RedisCluster
        | aiocluster.ClusterPipeline,
    )


def atomic_pipeline(client: Any) -> Any:
    """A ``MULTI`` pipeline; on a cluster, whose keys span slots, a plain one.

    Callers use it where atomicity is a convenience (one writer per key), not a
    guarantee they rely on.
    """
    return client.pipeline(transaction=not is_cluster(client))


def connect_async(
    url: str,
    *,
    socket_timeout: float | None = 5.0,
    max_connections: int = 4096,
    cluster: bool = False,
) -> aioredis.Redis:
    """An asyncio client (connection pool) for ``url``; ``cluster``: a Redis Cluster
    client, ``url`` naming any of its nodes (typed as a plain client: the commands the
    gateway uses are the same, and every key of one stream shares a slot).

    The pool is large: redis-py's own default (100 in redis-py 8) fails calls at
    once beyond it, which a burst of a few hundred resumes reaches
    (tests/core/redis/test_connection.py).

    Note: with a socket timeout set, redis-py (7.4 and 8.1 on Python 3.11 at
    least) often swallows the cancellation of a task awaiting a command, so
    long-running loops here also stop on a ``_closed`` flag, not on cancel alone.
    """
    opts = _options(socket_timeout) | {"max_connections": max_connections}
    if cluster:
        retry = AsyncRetry(ConstantBackoff(0.05), retries=2)
        return aiocluster.RedisCluster.from_url(url, retry=retry, **opts)  # type: ignore[return-value]
    return aioredis.Redis.from_url(url, retry=_retry(), **opts)


def connect_sync(
    url: str, *, socket_timeout: float | None = 5.0, cluster: bool = False
) -> redis.Redis:
    """A blocking client (connection pool) for ``url``; ``cluster``: see :func:`connect_async`."""
    opts = _options(socket_timeout)
    if cluster:
        retry = Retry(ConstantBackoff(0.05), retries=2)
        return redis.cluster.RedisCluster.from_url(url, retry=retry, **opts)  # type: ignore[return-value]
    return redis.Redis.from_url(url, retry=_retry(), **opts)


def _options(socket_timeout: float | None) -> dict[str, Any]:
    """What every client here is made with (RESP2, a short connect timeout, no health
    checks), besides its retry policy."""
    return {
        "protocol": 2,
        "socket_connect_timeout": 1.0,
        "socket_timeout": socket_timeout,
        "health_check_interval": 0,
        **_identity(),
    }


def raise_if_cancel_swallowed() -> None:
    """Raise ``CancelledError`` if this task was cancelled during a call that swallowed it.

    redis-py may catch the cancellation of a command in flight and return
    normally (see :func:`connect_async`); the task's cancel request is still
    counted (``Task.cancelling()``). Loops that must stop when cancelled call
    this after their Redis calls. Not for cleanup that runs after a cancel (a
    ``finally`` block), where the count is already set.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


@functools.cache
def _identity() -> dict[str, Any]:
    """The client name redis-py sends on connect (``CLIENT SETINFO``), resolved once.

    redis-py 7+ otherwise builds it for every new connection from the installed
    package's metadata: during a burst of new pool
    connections that was most of the gateway's time. Older redis-py resolves it
    once at import and takes no argument for it.
    """
    try:
        from redis.driver_info import DriverInfo
    except ImportError:
        return {}
    return {"driver_info": DriverInfo()}


class RedisHealth:
    """Tracks whether Redis answers (and takes writes); logs only when that changes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.up = True
        self.full = False  # down because Redis is at maxmemory (refusing writes)
        self.down_since: float | None = None
        self._lock = threading.Lock()

    def ok(self) -> None:
        """Record a successful call."""
        if self.up:
            return
        with self._lock:
            if self.up:
                return
            outage = time.monotonic() - (self.down_since or time.monotonic())
            full, self.up, self.full, self.down_since = self.full, True, False, None
        extra = {"component": self.name, "outage_s": round(outage, 1)}
        log.warning("redis takes writes again" if full else "redis is reachable again", extra=extra)

    def failed(self, exc: BaseException) -> None:
        """Record a failed call (logs only on the first failure of an outage)."""
        if not self.up:
            return
        with self._lock:
            if not self.up:
                return
            self.up, self.full, self.down_since = False, is_full(exc), time.monotonic()
        extra = {"component": self.name, "error": str(exc)[:200]}
        if self.full:
            log.warning("redis is full (maxmemory): writes are refused", extra=extra)
        else:
            log.warning("redis is unreachable: %s", exc.__class__.__name__, extra=extra)


class Backoff:
    """Exponential backoff delays for reconnect loops (reset on success)."""

    def __init__(self, first: float = 0.05, cap: float = 1.0) -> None:
        self.first, self.cap = first, cap
        self.delay = first

    def next(self) -> float:
        delay, self.delay = self.delay, min(self.cap, self.delay * 2)
        return delay

    def reset(self) -> None:
        self.delay = self.first
