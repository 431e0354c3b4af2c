"""Redis key names, consumer group and timings: where gateways and workers meet.

Key layout (``P`` is the key prefix, ``tr:`` by default):

- ``P requests:<model>``: a Redis Stream of the generate requests for one model
  (:meth:`Keys.queue`); the workers that serve the model (they announce its name in
  their stats, core/wire/stats.py) read it as the consumer group ``workers`` (each
  request goes to exactly one worker, which acknowledges it when its stream is
  finished). ``P requests`` is the queue of workers that name no model.
- ``P control``: a Redis Stream of cancel notices that every worker reads.
- ``P s:{stream_id}``: the event log of one response (the braces are literal: a
  Redis Cluster hash tag, so every key of one stream lives in one slot). Entry ids *are* the
  offsets: the event with seq ``n`` has the id ``n-1``. Seq 0 is the worker's
  ``accepted`` marker; token events are 1..n-1 and the ``done`` event is the
  last. Every append goes through :data:`APPEND_LUA`, which checks that the
  log ends exactly at ``first_seq - 1``: a write can never leave a gap or a
  duplicate, and two writers racing to end a stream cannot both win.
- ``P m:{stream_id}``: the stream's metadata hash (see :class:`Meta`).
- ``P a:{stream_id}``: sorted set of attached clients (member = attachment
  id, score = expiry in Redis server milliseconds).
- ``P events``: a pub/sub channel on which every append is published as
  it lands (:func:`decode_published`), so gateways need not poll the logs.
  On a Redis Cluster (``--redis-cluster``) each stream has its own sharded
  channel ``P e:{stream_id}`` instead (``SPUBLISH`` on the stream's shard only),
  and each request queue is split over :data:`QUEUE_SHARDS` streams
  ``P requests:{qN}[:<model>]``, spread over the slot space, so no shard is hot; a
  gateway that queues a request on one of them wakes idle workers on that shard's
  channel ``P wake:{qN}[:<model>]`` (:meth:`Keys.wakes`).
- ``P lb:{<owner>}`` and ``P lb:{<owner>}:b``: the stream logs one API key (or client
  address) holds in Redis, and their bytes (core/wire/log_ledger.py).
- ``P w:<worker_id>``: a worker's heartbeat hash (stats), expiring after a
  few seconds unless refreshed; ``P workers`` is the set of worker ids.
"""

from __future__ import annotations

import binascii
import os
import re

GROUP = "workers"


DEFAULT_PREFIX = "tr:"


STREAM_ID_RE = re.compile(r"[A-Za-z0-9_-]{16,64}")  # fullmatch: `$` would allow a "\n"


# Timing shared by gateways and workers (seconds).
HEARTBEAT_INTERVAL = 1.0  # a worker refreshes its heartbeat this often

# The one setting of how fast a dead worker's streams move on: a worker whose heartbeat is
# this old is dead (its key expires), and a live worker takes its streams over within
# CLAIM_INTERVAL more (worker/continuation.py). Every process reads it from the same
# environment variable (`tokenrelay serve` passes its environment to the worker).
DEAD_AFTER_ENV = "TOKENRELAY_WORKER_DEAD_AFTER"
DEAD_AFTER_DEFAULT = 3.0
DEAD_AFTER_RANGE = (1.5, 300.0)  # above the heartbeat interval, with a beat to spare


def worker_dead_after(environ: dict[str, str] | None = None) -> float:
    """``TOKENRELAY_WORKER_DEAD_AFTER`` in seconds (default 3); ``ValueError`` for a bad one."""
    raw = (os.environ if environ is None else environ).get(DEAD_AFTER_ENV, "").strip()
    if not raw:
        return DEAD_AFTER_DEFAULT
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{DEAD_AFTER_ENV}: expected seconds, got {raw!r}") from None
    lo, hi = DEAD_AFTER_RANGE
    if not lo <= value <= hi:
        raise ValueError(f"{DEAD_AFTER_ENV}: {value:g} s is outside [{lo:g}, {hi:g}] s")
    return value


def _dead_after_or_default() -> float:
    try:
        return worker_dead_after()
    except ValueError:  # the processes' settings refuse it with this message at start
        return DEAD_AFTER_DEFAULT


HEARTBEAT_TTL = _dead_after_or_default()  # a worker is presumed dead this long after a beat

CLAIM_INTERVAL = 0.5  # a worker looks for streams of dead workers this often

# A gateway's backstop: a running stream whose worker has been gone this long, and that no
# worker continued meanwhile (none serves its model, or serve gave up), ends with `error`.
CONTINUE_DEADLINE = 120.0


ATTACH_TTL = 6.0  # an attachment lapses this long after its last refresh


ATTACH_REFRESH = 2.0  # gateways refresh attachments this often


MAX_MODEL_NAME = 256  # characters of a model name a worker may announce (it is in a key)


ACTIVE_TTL = 86400.0  # safety expiry of a stream that never finishes

# Lengths (entries) Redis keeps of its streams.
MAXLEN = 100_000  # events kept per stream, at most (max_tokens is capped far below)
CONTROL_MAXLEN = 10_000  # cancel notices kept on the control stream

SLOTS = 16384  # Redis Cluster hash slots
QUEUE_SHARDS = 16  # request-queue streams per model on a Redis Cluster


def slot_of(key: str) -> int:
    """The Redis Cluster hash slot of ``key`` (CRC16/XMODEM of its hash tag, mod 16384)."""
    raw = key.encode()
    start = raw.find(b"{")
    if start >= 0:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            raw = raw[start + 1 : end]
    return binascii.crc_hqx(raw, 0) % SLOTS


def _shard_tags(n: int) -> list[str]:
    """``n`` hash tags ``q…`` whose slots fall one in each n-th of the slot space, so the
    queue shards spread over the masters of an evenly split cluster."""
    tags: list[str] = []
    i = 0
    for shard in range(n):
        low, high = shard * SLOTS // n, (shard + 1) * SLOTS // n
        while not low <= slot_of(f"{{q{i}}}") < high:
            i += 1
        tags.append(f"q{i}")
    return tags


SHARD_TAGS = _shard_tags(QUEUE_SHARDS)


class Keys:
    """Redis key names under one prefix; ``cluster``: the Redis Cluster layout."""

    def __init__(self, prefix: str = DEFAULT_PREFIX, *, cluster: bool = False) -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"--redis-prefix {prefix!r}: braces are Redis Cluster hash tags")
        self.prefix = prefix
        self.cluster = cluster
        self.requests = prefix + "requests"
        self.control = prefix + "control"
        self.workers = prefix + "workers"
        self.events = prefix + "events"  # pub/sub channel: every append, as it lands

    def queue(self, model: str | None) -> str:
        """The request queue of ``model``; ``None`` (or ""): that of workers naming none.

        On a cluster, the first of its :meth:`queue_shards`.
        """
        return self.queue_shards(model)[0]

    def queue_shards(self, model: str | None) -> list[str]:
        """Every stream of ``model``'s request queue: one, or :data:`QUEUE_SHARDS` on a cluster."""
        if not self.cluster:
            return [f"{self.requests}:{model}" if model else self.requests]
        tail = f":{model}" if model else ""
        return [f"{self.requests}:{{{tag}}}{tail}" for tag in SHARD_TAGS]

    def stream(self, stream_id: str) -> str:
        return f"{self.prefix}s:{{{stream_id}}}"

    def meta(self, stream_id: str) -> str:
        return f"{self.prefix}m:{{{stream_id}}}"

    def attach(self, stream_id: str) -> str:
        return f"{self.prefix}a:{{{stream_id}}}"

    def wakes(self, model: str | None) -> list[str]:
        """The sharded channels on which a gateway wakes idle workers of ``model`` when it
        queues a request (cluster only: worker/shards.py): one per queue shard, in that
        shard's slot, so a master that is down takes only its own shards' wake-ups with it.
        """
        tail = f":{model}" if model else ""
        return [f"{self.prefix}wake:{{{tag}}}{tail}" for tag in SHARD_TAGS]

    def channel(self, stream_id: str) -> str:
        """The stream's own sharded pub/sub channel (cluster only; see the module doc)."""
        return f"{self.prefix}e:{{{stream_id}}}"

    def ledger(self, owner: str) -> tuple[str, str]:
        """The stream-log bytes ``owner`` (a limits bucket: a key, an address) holds in
        Redis: its ledger and the ledger's bytes, in one slot (core/wire/log_ledger.py)."""
        ledger = f"{self.prefix}lb:{{{owner}}}"
        return ledger, ledger + ":b"

    def rate_bucket(self, bucket: str) -> str:
        """A per-key (or per-address) rate limit's token bucket (``BUCKET_LUA``)."""
        return f"{self.prefix}rl:{bucket}"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}w:{worker_id}"
