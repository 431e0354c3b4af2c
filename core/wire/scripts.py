"""Every Lua script tokenrelay runs in Redis, with the code that builds and decodes its calls.

Scripts run atomically, so each one is a rule that no race can break:

- :data:`APPEND_LUA`: append a step's events to many stream logs, gapless, and
  publish them; :data:`RELEASE_LUA`: hand an unstarted stream back to the queue;
  :data:`TAKEOVER_LUA`: a live worker takes a dead worker's running stream;
- :data:`ATTACH_LUA`, :data:`DETACH_LUA`, :data:`ATTACHED_LUA`: attachments of
  clients to streams, in Redis' own clock;
- :data:`COUNT_LUA`: count resumes and disconnects in a stream's metadata;
- :data:`BUCKET_LUA`: the per-key rate limit's token bucket.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from string import Template
from typing import Any

from tokenrelay.core.wire.events import (
    DONE,
    TOKEN,
    Event,
    F,
    decode_event,
    entry_id,
    event_from_fields,
)
from tokenrelay.core.wire.keys import Keys, slot_of
from tokenrelay.core.wire.records import MetaField
from tokenrelay.core.wire.vocabulary import EventKind, StreamStatus

# The names the scripts share with the Python side: each script's source says '$ST' where
# it means the metadata's status field, and so on (substituted once, at import).
_NAMES = {
    "ST": MetaField.STATUS,
    "W": MetaField.WORKER,
    "PT": MetaField.PROMPT_TOKENS,
    "LAST": MetaField.LAST_SEQ,
    "FR": MetaField.FINISH_REASON,
    "TO": MetaField.TAKEOVERS,
    "QUEUED": StreamStatus.QUEUED,
    "RUNNING": StreamStatus.RUNNING,
    "DONE": StreamStatus.DONE,
    "K": F.KIND,
    "KDONE": DONE,
    "R": F.REASON,
}


def _lua(source: str) -> str:
    return Template(source).substitute(_NAMES)


# KEYS: per stream: its log, meta and attach keys (3 per stream).
# ARGV: channel ('' = publish nothing), maxlen, then one JSON array with an entry
#   per stream (in KEYS order): [stream_id, first_seq, done_ttl_s, events, meta, owner],
#   then '1' on a Redis Cluster (see APPEND_CLUSTER_LUA), with the key prefix P: KEYS
#   are then the first stream's only (they route the call), the script names each
#   stream's keys itself, ARGV[1] is the prefix of the streams' own channels, and each
#   stream's events are published with SPUBLISH on its channel (in its slot),
#   events a list of flat [f1, v1, ...] lists, meta a flat [m1, v1, ...] list.
#   One JSON argument, not a dozen per stream: cheaper to build and send, and
#   cjson decodes it in C (bench/redis_append.py).
# For each stream: appends its events with ids first_seq.. only if the log
# ends at first_seq-1, the stream is not done and, when an owner is named and
# first_seq > 0, the meta's worker is that owner (a worker presumed dead whose
# stream another worker took over writes nothing more: TAKEOVER_LUA). A done event (k=d) marks the
# meta done (st, last, fr) and sets the TTL of the stream, its meta and its
# attachments to done_ttl_s. Returns one answer per stream:
#   {1, last_seq}                 written
#   {0, last_seq, top fields...}  the log does not end at first_seq-1
#   {-1}                          unknown or expired stream (no meta)
#   {-2, last_seq, top fields...} the stream is already done
#   {-3, last_seq}                another worker owns the stream now
# Then publishes what was written, as one message on the channel with Redis'
# clock (see decode_published): gateways deliver live events from it without reading
# every log. The log stays the truth; the message is only a fast path.
APPEND_LUA = _lua("""
local channel = ARGV[1]
local maxlen = ARGV[2]
local streams = cjson.decode(ARGV[3])
local sharded = ARGV[4] == '1'
local prefix = ARGV[5]
local call = redis.call
local answers = {}
local published = {}
for s = 1, #streams do
  local one = streams[s]
  local klog, kmeta, kattach = KEYS[3 * s - 2], KEYS[3 * s - 1], KEYS[3 * s]
  if sharded then
    local tag = '{' .. one[1] .. '}'
    klog, kmeta, kattach = prefix .. 's:' .. tag, prefix .. 'm:' .. tag, prefix .. 'a:' .. tag
  end
  local first, evs = one[2], one[4]
  local st = call('HGET', kmeta, '$ST')
  if not st then
    answers[s] = {-1}
  else
    local last = -1
    local top = call('XREVRANGE', klog, '+', '-', 'COUNT', 1)
    if #top > 0 then last = tonumber(string.match(top[1][1], '^(%d+)')) end
    local code = 1
    local owner = one[6]
    if st == '$DONE' then
      code = -2
    elseif owner and owner ~= '' and first > 0 and call('HGET', kmeta, '$W') ~= owner then
      code = -3
    elseif last ~= first - 1 then
      code = 0
    end
    if code == -3 then
      answers[s] = {code, last}
    elseif code ~= 1 then
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
        if ev[1] == '$K' and ev[2] == '$KDONE' then
          reason = ''
          for x = 1, #ev, 2 do
            if ev[x] == '$R' then reason = ev[x + 1] end
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
        call('HSET', kmeta, '$ST', '$DONE', '$LAST', seq - 1, '$FR', reason)
        call('EXPIRE', klog, ttl)
        call('EXPIRE', kmeta, ttl)
        call('EXPIRE', kattach, ttl)
      end
      if #evs > 0 then published[#published + 1] = {one[1], first, evs} end
      answers[s] = {1, seq - 1}
    end
  end
end
if channel ~= '' and #published > 0 then
  local t = call('TIME')
  local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if sharded then
    for p = 1, #published do
      local one = published[p]
      call('SPUBLISH', channel .. '{' .. one[1] .. '}', cjson.encode({ms, {one}}))
    end
  else
    call('PUBLISH', channel, cjson.encode({ms, published}))
  end
end
return answers
""")

# The same script for a Redis Cluster (Redis >= 7): the keys it touches may span slots, as
# long as the master it runs on serves them all, so one call appends a step's events for
# every stream of one master (worker/store.py groups them by the slot map). Redis still
# wants a call's declared KEYS in one slot: the first stream's are declared, the script
# names the others. A single stream's call needs no flag; the plain script serves it.
APPEND_CLUSTER_LUA = "#!lua flags=allow-cross-slot-keys\n" + APPEND_LUA


APPEND_CHUNK = 128  # streams per APPEND_LUA call: bounds how long one call holds Redis


@dataclass(frozen=True)
class Append:
    """Events of one stream to append (seq ``first_seq`` onwards), and metadata to set."""

    stream_id: str
    first_seq: int
    events: list[list[str]]
    meta: dict[str, str] | None = None
    done_ttl: float = 3600.0
    # a worker id: written only while the stream's meta names it (fencing; keyword-only)
    owner: str = field(default="", kw_only=True)


# the APPEND_LUA argument: compact, and UTF-8 as is (cjson decodes both)
_encode_streams = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), check_circular=False
).encode


def append_call(
    keys: Keys, appends: Sequence[Append], *, maxlen: int
) -> tuple[list[str], list[str]]:
    """``(KEYS, ARGV)`` of one :data:`APPEND_LUA` call for ``appends``.

    On a cluster (``keys.cluster``) each stream is published on its own channel; a call
    of several streams must be :data:`APPEND_CLUSTER_LUA`, on the master of them all.
    """
    key_list: list[str] = []
    rows: list[list[Any]] = []
    for a in appends:
        sid = a.stream_id
        key_list += (keys.stream(sid), keys.meta(sid), keys.attach(sid))
        pairs = [x for kv in a.meta.items() for x in kv] if a.meta else []
        rows.append([sid, a.first_seq, max(1, round(a.done_ttl)), a.events, pairs, a.owner])
    rows_arg = _encode_streams(rows)
    if keys.cluster:  # "P e:": the script adds "{id}"; KEYS: the first stream's
        return key_list[:3], [keys.channel("")[:-2], str(maxlen), rows_arg, "1", keys.prefix]
    return key_list, [keys.events, str(maxlen), rows_arg, ""]


def append_groups(
    keys: Keys, appends: Sequence[Append], master_of: Callable[[int], str] | None = None
) -> list[list[int]]:
    """Indices of ``appends``, one list per :data:`APPEND_LUA` call: chunks of
    :data:`APPEND_CHUNK`; with ``master_of`` (a cluster: slot -> its master's name), of
    streams of one master each, in their order."""
    groups: dict[str, list[int]] = {}
    for i, a in enumerate(appends):
        node = master_of(slot_of(keys.stream(a.stream_id))) if master_of else ""
        groups.setdefault(node, []).append(i)
    return [
        g[at : at + APPEND_CHUNK] for g in groups.values() for at in range(0, len(g), APPEND_CHUNK)
    ]


@dataclass(frozen=True)
class AppendResult:
    """The decoded answer of :data:`APPEND_LUA`."""

    status: int  # 1 written, 0 conflict, -1 no such stream, -2 already done, -3 not the owner
    last_seq: int = -1
    top: Event | None = None


OWNED_ELSEWHERE = -3  # AppendResult.status: another worker took the stream over


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
            if (
                flat[0] == F.KIND
                and flat[1] == TOKEN
                and (  # the common case: text (and ids)
                    len(flat) == 4 or (len(flat) == 6 and flat[4] == F.TOKEN_IDS)
                )
            ):
                events.append(Event(first + n, EventKind.TOKEN, flat[3]))
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
DETACH_LUA = _lua("""
local out = {}
for i = 1, #ARGV - 1 do
  local meta = KEYS[2 * i]
  redis.call('ZREM', KEYS[2 * i - 1], ARGV[i + 1])
  out[i] = 0
  if redis.call('EXISTS', meta) == 1 and redis.call('HGET', meta, '$ST') ~= '$DONE' then
    redis.call('HINCRBY', meta, ARGV[1], 1)
    out[i] = 1
  end
end
return out
""")


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


# KEYS: meta.  ARGV: field.  HINCRBY on an existing stream only (never creates
# a meta hash, so its expiry is kept).
COUNT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
return redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
"""


# KEYS[1] bucket hash; ARGV: capacity, tokens per ms, cost.
# Returns {allowed (0/1), ms until enough tokens, tokens left (floor)}.
BUCKET_LUA = """
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then
  tokens = capacity
  ts = now
end
if now > ts then
  tokens = math.min(capacity, tokens + (now - ts) * rate)
  ts = now
end
local allowed = 0
local wait = 0
if tokens >= cost then
  tokens = tokens - cost
  allowed = 1
else
  wait = math.ceil((cost - tokens) / rate)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(ts))
redis.call('PEXPIRE', KEYS[1], math.ceil(capacity / rate) + 1000)
return {allowed, wait, math.floor(tokens)}
"""


# KEYS: meta.  ARGV: the dead worker's id (as the meta names it), the taker's.  Only while
# the stream runs under that worker (two takers: one wins), the meta names the taker from
# then on (APPEND_LUA refuses the old worker's writes). Returns the takeovers so far, or 0.
TAKEOVER_LUA = _lua("""
if redis.call('HGET', KEYS[1], '$ST') ~= '$RUNNING' then return 0 end
if redis.call('HGET', KEYS[1], '$W') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], '$W', ARGV[2])
return redis.call('HINCRBY', KEYS[1], '$TO', 1)
""")


# KEYS: stream, meta.  ARGV: worker id.  Hands an unstarted stream back to the
# queue: only while this worker runs it and its log holds nothing but the
# seq-0 ``accepted`` marker. The log is deleted (the next worker writes seq 0
# again) and the metadata says ``queued``. Returns 1 when handed back.
RELEASE_LUA = _lua("""
local st = redis.call('HGET', KEYS[2], '$ST')
if st == '$QUEUED' then return 1 end
if st ~= '$RUNNING' or redis.call('HGET', KEYS[2], '$W') ~= ARGV[1] then return 0 end
if redis.call('XLEN', KEYS[1]) > 1 then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[2], '$ST', '$QUEUED')
redis.call('HDEL', KEYS[2], '$W', '$PT')
return 1
""")
