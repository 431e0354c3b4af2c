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
- ``P w:{worker_id}``: a worker's heartbeat hash (stats), expiring after a
  few seconds unless refreshed; ``P workers`` is the set of worker ids.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
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


@dataclass(frozen=True)
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
    f = {_s(k): _s(v) for k, v in fields.items()}
    kind = _KIND_NAMES.get(f.get("k", ""), "unknown")
    return Event(
        seq=seq_of(eid),
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


# KEYS: stream, meta.  ARGV: first_seq, maxlen, done_ttl_s, n_events,
#   then per event: n_field_values, f1, v1, ...; then n_meta_values, m1, v1, ...
# Appends the events with ids first_seq.. only if the log ends at first_seq-1
# and the stream is not done. A done event (k=d) marks the meta done (st, last,
# fr) and sets the TTL of the stream, its meta and its attachments to
# done_ttl_s. Returns:
#   {1, last_seq}                 written
#   {0, last_seq, top fields...}  the log does not end at first_seq-1
#   {-1}                          unknown or expired stream (no meta)
#   {-2, last_seq, top fields...} the stream is already done
APPEND_LUA = """
if redis.call('EXISTS', KEYS[2]) == 0 then return {-1} end
local last = -1
local topf = {}
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #top > 0 then
  last = tonumber(string.match(top[1][1], '^(%d+)'))
  topf = top[1][2]
end
local function answer(code)
  local out = {code, last}
  for i = 1, #topf do out[#out + 1] = topf[i] end
  return out
end
if redis.call('HGET', KEYS[2], 'st') == 'done' then return answer(-2) end
local seq = tonumber(ARGV[1])
if last ~= seq - 1 then return answer(0) end
local maxlen = ARGV[2]
local ttl = tonumber(ARGV[3])
local n = tonumber(ARGV[4])
local i = 5
local finished = false
local reason = ''
for _ = 1, n do
  local nf = tonumber(ARGV[i])
  local args = {'XADD', KEYS[1], 'MAXLEN', '~', maxlen, seq .. '-1'}
  for j = 1, nf do args[#args + 1] = ARGV[i + j] end
  for j = 1, nf, 2 do
    if ARGV[i + j] == 'k' and ARGV[i + j + 1] == 'd' then finished = true end
    if ARGV[i + j] == 'r' then reason = ARGV[i + j + 1] end
  end
  redis.call(unpack(args))
  i = i + nf + 1
  seq = seq + 1
end
local nm = tonumber(ARGV[i])
if nm > 0 then
  local args = {'HSET', KEYS[2]}
  for j = 1, nm do args[#args + 1] = ARGV[i + j] end
  redis.call(unpack(args))
end
if finished then
  redis.call('HSET', KEYS[2], 'st', 'done', 'last', seq - 1, 'fr', reason)
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
  redis.call('EXPIRE', KEYS[3], ttl)
end
return {1, seq - 1}
"""


def append_args(
    first_seq: int,
    events: list[list[str]],
    meta: dict[str, str] | None,
    *,
    maxlen: int,
    done_ttl: float,
) -> list[str]:
    """The ARGV of :data:`APPEND_LUA` (KEYS: stream, meta, attach)."""
    argv = [str(first_seq), str(maxlen), str(max(1, round(done_ttl))), str(len(events))]
    for fields in events:
        argv.append(str(len(fields)))
        argv.extend(fields)
    pairs = [x for kv in (meta or {}).items() for x in kv]
    argv.append(str(len(pairs)))
    argv.extend(pairs)
    return argv


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


# KEYS: attach zset.  ARGV: member, ttl_ms.  Adds/refreshes one attachment
# with an expiry in Redis server time (no clock skew between machines).
ATTACH_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 2)
return 1
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
