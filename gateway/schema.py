"""The Redis schema shared by gateways and engine workers: keys, events, scripts.

Key layout (``P`` is the key prefix, ``tr:`` by default):

- ``P requests``: a Redis Stream of generate requests; engine workers read it as
  the consumer group ``workers`` (each request goes to exactly one worker,
  which acknowledges it when its stream is finished).
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

import hashlib
import hmac
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GROUP = "workers"
DEFAULT_PREFIX = "tr:"
STREAM_ID_RE = re.compile(r"^[A-Za-z0-9_-]{16,64}$")

# Timing shared by gateways and workers (seconds).
HEARTBEAT_INTERVAL = 1.0  # a worker refreshes its heartbeat this often
HEARTBEAT_TTL = 3.0  # ... and is presumed dead this long after the last one
WORKER_DEAD_GRACE = 2.0  # a heartbeat must stay missing this long to declare death
ATTACH_TTL = 6.0  # an attachment lapses this long after its last refresh
ATTACH_REFRESH = 2.0  # gateways refresh attachments this often
ACTIVE_TTL = 86400.0  # safety expiry of a stream that never finishes


class Keys:
    """Redis key names under one prefix."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = prefix
        self.requests = prefix + "requests"
        self.control = prefix + "control"
        self.workers = prefix + "workers"
        self.events = prefix + "events"  # pub/sub channel: every append, as it lands

    def stream(self, stream_id: str) -> str:
        return f"{self.prefix}s:{stream_id}"

    def meta(self, stream_id: str) -> str:
        return f"{self.prefix}m:{stream_id}"

    def attach(self, stream_id: str) -> str:
        return f"{self.prefix}a:{stream_id}"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}w:{worker_id}"


def new_stream_id() -> str:
    """An unguessable stream id (128 random bits, URL-safe)."""
    return secrets.token_urlsafe(16)


def new_resume_token() -> str:
    """A secret resume token (256 random bits); only its hash is stored."""
    return secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def token_matches(token: str, stored_hash: str) -> bool:
    """Constant-time check of a resume token against its stored hash."""
    return hmac.compare_digest(hash_token(token), stored_hash)


def entry_id(seq: int) -> str:
    return f"{seq}-1"


def seq_of(entry_id: bytes | str) -> int:
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-", 1)[0])


# Event kinds as stored (one letter keeps entries small).
ACCEPTED, TOKEN, DONE, REJECTED = "a", "t", "d", "x"


@dataclass(slots=True)
class Event:
    """One entry of a stream's log, decoded.

    ``kind`` is ``accepted`` (seq 0: a worker took the request), ``rejected``
    (seq 0: the worker refused it; ``code``/``message`` say why), ``token``
    (``text``) or ``done`` (``finish_reason``, usage, ``message`` for errors).
    """

    seq: int
    kind: str
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    code: str | None = None
    message: str | None = None
    worker: str | None = None


_KIND_NAMES = {ACCEPTED: "accepted", TOKEN: "token", DONE: "done", REJECTED: "rejected"}


def _s(value: Any) -> str:
    return value.decode("utf-8", "surrogatepass") if isinstance(value, bytes) else str(value)


def decode_event(eid: bytes | str, fields: dict[Any, Any]) -> Event:
    """Build an :class:`Event` from one stream entry (bytes or str fields)."""
    return event_from_fields(seq_of(eid), {_s(k): _s(v) for k, v in fields.items()})


def event_from_fields(seq: int, f: dict[str, str]) -> Event:
    """Build the :class:`Event` with seq ``seq`` from its stored fields."""
    kind = _KIND_NAMES.get(f.get("k", ""), "unknown")
    return Event(
        seq=seq,
        kind=kind,
        text=f.get("x", ""),
        finish_reason=f.get("r"),
        prompt_tokens=int(f.get("pt", 0) or 0),
        completion_tokens=int(f.get("n", 0) or 0),
        code=f.get("c"),
        message=f.get("m"),
        worker=f.get("w"),
    )


def token_fields(text: str) -> list[str]:
    return ["k", TOKEN, "x", text]


def accepted_fields(prompt_tokens: int, worker: str) -> list[str]:
    return ["k", ACCEPTED, "pt", str(prompt_tokens), "w", worker]


def rejected_fields(code: str, message: str) -> list[str]:
    return ["k", REJECTED, "c", code, "m", message]


def done_fields(
    reason: str, prompt_tokens: int, completion_tokens: int, message: str | None = None
) -> list[str]:
    out = ["k", DONE, "r", reason, "pt", str(prompt_tokens), "n", str(completion_tokens)]
    if message:
        out += ["m", message]
    return out


# KEYS: per stream: its log, meta and attach keys (3 per stream).
# ARGV: channel ('' = publish nothing), maxlen, then one JSON array with an entry
#   per stream (in KEYS order): [stream_id, first_seq, done_ttl_s, events, meta],
#   events a list of flat [f1, v1, ...] lists, meta a flat [m1, v1, ...] list.
#   One JSON argument, not a dozen per stream: cheaper to build and send, and
#   cjson decodes it in C (bench/redis_append.py).
# For each stream: appends its events with ids first_seq.. only if the log
# ends at first_seq-1 and the stream is not done. A done event (k=d) marks the
# meta done (st, last, fr) and sets the TTL of the stream, its meta and its
# attachments to done_ttl_s. Returns one answer per stream:
#   {1, last_seq}                 written
#   {0, last_seq, top fields...}  the log does not end at first_seq-1
#   {-1}                          unknown or expired stream (no meta)
#   {-2, last_seq, top fields...} the stream is already done
# Then publishes what was written, as one message on the channel with Redis'
# clock (see decode_published): gateways deliver live events from it without reading
# every log. The log stays the truth; the message is only a fast path.
APPEND_LUA = """
local channel = ARGV[1]
local maxlen = ARGV[2]
local streams = cjson.decode(ARGV[3])
local call = redis.call
local answers = {}
local published = {}
for s = 1, #streams do
  local one = streams[s]
  local klog, kmeta = KEYS[3 * s - 2], KEYS[3 * s - 1]
  local first, evs = one[2], one[4]
  local st = call('HGET', kmeta, 'st')
  if not st then
    answers[s] = {-1}
  else
    local last = -1
    local top = call('XREVRANGE', klog, '+', '-', 'COUNT', 1)
    if #top > 0 then last = tonumber(string.match(top[1][1], '^(%d+)')) end
    local code = 1
    if st == 'done' then
      code = -2
    elseif last ~= first - 1 then
      code = 0
    end
    if code ~= 1 then
      local out = {code, last}
      if #top > 0 then
        local topf = top[1][2]
        for x = 1, #topf do out[#out + 1] = topf[x] end
      end
      answers[s] = out
    else
      local seq = first
      local reason = nil
      for e = 1, #evs do
        local ev = evs[e]
        call('XADD', klog, 'MAXLEN', '~', maxlen, seq .. '-1', unpack(ev))
        if ev[1] == 'k' and ev[2] == 'd' then
          reason = ''
          for x = 1, #ev, 2 do
            if ev[x] == 'r' then reason = ev[x + 1] end
          end
        end
        seq = seq + 1
      end
      local meta = one[5]
      if #meta > 0 then
        call('HSET', kmeta, unpack(meta))
      end
      if reason then
        local ttl = one[3]
        call('HSET', kmeta, 'st', 'done', 'last', seq - 1, 'fr', reason)
        call('EXPIRE', klog, ttl)
        call('EXPIRE', kmeta, ttl)
        call('EXPIRE', KEYS[3 * s], ttl)
      end
      if #evs > 0 then published[#published + 1] = {one[1], first, evs} end
      answers[s] = {1, seq - 1}
    end
  end
end
if channel ~= '' and #published > 0 then
  local t = call('TIME')
  local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  call('PUBLISH', channel, cjson.encode({ms, published}))
end
return answers
"""

APPEND_CHUNK = 128  # streams per APPEND_LUA call: bounds how long one call holds Redis


@dataclass(frozen=True)
class Append:
    """Events of one stream to append (seq ``first_seq`` onwards), and metadata to set."""

    stream_id: str
    first_seq: int
    events: list[list[str]]
    meta: dict[str, str] | None = None
    done_ttl: float = 3600.0


# the APPEND_LUA argument: compact, and UTF-8 as is (cjson decodes both)
_encode_streams = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), check_circular=False
).encode


def append_call(
    keys: Keys, appends: Sequence[Append], *, maxlen: int
) -> tuple[list[str], list[str]]:
    """``(KEYS, ARGV)`` of one :data:`APPEND_LUA` call for ``appends``."""
    key_list: list[str] = []
    rows: list[list[Any]] = []
    for a in appends:
        sid = a.stream_id
        key_list += (keys.stream(sid), keys.meta(sid), keys.attach(sid))
        pairs = [x for kv in a.meta.items() for x in kv] if a.meta else []
        rows.append([sid, a.first_seq, max(1, round(a.done_ttl)), a.events, pairs])
    return key_list, [keys.events, str(maxlen), _encode_streams(rows)]


@dataclass(frozen=True)
class AppendResult:
    """The decoded answer of :data:`APPEND_LUA`."""

    status: int  # 1 written, 0 conflict, -1 no such stream, -2 already done
    last_seq: int = -1
    top: Event | None = None


def decode_append(raw: Any) -> AppendResult:
    status = int(raw[0])
    if status == -1:
        return AppendResult(-1)
    last = int(raw[1])
    top = None
    if len(raw) > 2:
        flat = raw[2:]
        top = decode_event(entry_id(last), dict(zip(flat[0::2], flat[1::2], strict=True)))
    return AppendResult(status, last, top)


def decode_published(payload: bytes | str) -> tuple[int, list[tuple[str, int, list[Event]]]]:
    """``(sent_ms, [(stream_id, first_seq, events)])`` from a message of the ``events`` channel.

    ``sent_ms``: Redis' clock when it was published (Unix time, milliseconds).
    Raises ``ValueError`` for a message that is not what :data:`APPEND_LUA` publishes.
    """
    sent_ms, streams = json.loads(payload)
    if not isinstance(sent_ms, int) or not isinstance(streams, list):
        raise ValueError("malformed events message")
    out = []
    for sid, first, evs in streams:
        if not isinstance(sid, str) or not isinstance(first, int) or not isinstance(evs, list):
            raise ValueError("malformed events message")
        events = []
        for n, flat in enumerate(evs):
            if len(flat) == 4 and flat[1] == TOKEN and flat[0] == "k":  # the common case
                events.append(Event(first + n, "token", flat[3]))
            else:
                fields = dict(zip(flat[0::2], flat[1::2], strict=True))
                events.append(event_from_fields(first + n, fields))
        out.append((sid, first, events))
    return sent_ms, out


# KEYS: attach zsets.  ARGV: ttl_ms, then one member per key.  Adds/refreshes
# each attachment with an expiry in Redis server time (no clock skew between
# machines); one call refreshes many (a gateway's periodic refresh).
ATTACH_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
for i = 1, #KEYS do
  redis.call('ZADD', KEYS[i], now + ttl, ARGV[i + 1])
  redis.call('PEXPIRE', KEYS[i], ttl * 2)
end
return #KEYS
"""

# KEYS: (attach zset, meta hash) per stream.  ARGV: a metadata field to count,
# then one attachment id per stream.  Removes each attachment; where its stream
# exists and is not done, HINCRBYs the field (a disconnect).  Returns 1 for each
# stream counted that way, else 0.
DETACH_LUA = """
local out = {}
for i = 1, #ARGV - 1 do
  local meta = KEYS[2 * i]
  redis.call('ZREM', KEYS[2 * i - 1], ARGV[i + 1])
  out[i] = 0
  if redis.call('EXISTS', meta) == 1 and redis.call('HGET', meta, 'st') ~= 'done' then
    redis.call('HINCRBY', meta, ARGV[1], 1)
    out[i] = 1
  end
end
return out
"""

# KEYS: attach zsets.  Returns the number of live attachments of each.
ATTACHED_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 1, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  out[i] = redis.call('ZCARD', KEYS[i])
end
return out
"""


def plan_finish(
    last_seq: int, prompt_tokens: int, reason: str, message: str | None
) -> tuple[int, list[list[str]]]:
    """``(first_seq, events)`` that end a stream from outside its worker.

    A stream that never ran (empty log) gets a seq-0 ``rejected`` marker saying
    why, then ``done`` at seq 1; otherwise ``done`` follows the last event.
    ``completion_tokens`` counts the token events written so far.
    """
    done = done_fields(reason, prompt_tokens, max(0, last_seq), message)
    if last_seq < 0:
        code = "cancelled" if reason == "cancelled" else "unavailable"
        return 0, [rejected_fields(code, message or reason), done]
    return last_seq + 1, [done]
