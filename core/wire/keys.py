"""Redis key names, consumer group and timings: where gateways and workers meet.

Key layout (``P`` is the key prefix, ``tr:`` by default):

- ``P requests:{model}``: a Redis Stream of the generate requests for one model
  (:meth:`Keys.queue`); the workers that serve the model (they announce its name in
  their stats, core/wire/stats.py) read it as the consumer group ``workers`` (each
  request goes to exactly one worker, which acknowledges it when its stream is
  finished). ``P requests`` is the queue of workers that name no model.
- ``P control``: a Redis Stream of cancel notices that every worker reads.
- ``P s:{stream_id}``: the event log of one response. Entry ids *are* the
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
- ``P w:{worker_id}``: a worker's heartbeat hash (stats), expiring after a
  few seconds unless refreshed; ``P workers`` is the set of worker ids.
"""

from __future__ import annotations

import re

GROUP = "workers"


DEFAULT_PREFIX = "tr:"


STREAM_ID_RE = re.compile(r"^[A-Za-z0-9_-]{16,64}$")


# Timing shared by gateways and workers (seconds).
HEARTBEAT_INTERVAL = 1.0  # a worker refreshes its heartbeat this often


HEARTBEAT_TTL = 3.0  # ... and is presumed dead this long after the last one


WORKER_DEAD_GRACE = 2.0  # a heartbeat must stay missing this long to declare death


ATTACH_TTL = 6.0  # an attachment lapses this long after its last refresh


ATTACH_REFRESH = 2.0  # gateways refresh attachments this often


MAX_MODEL_NAME = 256  # characters of a model name a worker may announce (it is in a key)


ACTIVE_TTL = 86400.0  # safety expiry of a stream that never finishes

# Lengths (entries) Redis keeps of its streams.
MAXLEN = 100_000  # events kept per stream, at most (max_tokens is capped far below)
CONTROL_MAXLEN = 10_000  # cancel notices kept on the control stream


class Keys:
    """Redis key names under one prefix."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = prefix
        self.requests = prefix + "requests"
        self.control = prefix + "control"
        self.workers = prefix + "workers"
        self.events = prefix + "events"  # pub/sub channel: every append, as it lands

    def queue(self, model: str | None) -> str:
        """The request queue of ``model``; ``None`` (or ""): that of workers naming none."""
        return f"{self.requests}:{model}" if model else self.requests

    def stream(self, stream_id: str) -> str:
        return f"{self.prefix}s:{stream_id}"

    def meta(self, stream_id: str) -> str:
        return f"{self.prefix}m:{stream_id}"

    def attach(self, stream_id: str) -> str:
        return f"{self.prefix}a:{stream_id}"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}w:{worker_id}"
