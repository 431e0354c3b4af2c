"""The stream-log bytes each API key holds in Redis: reserved up front, settled at the end.

A key (or, without keys, a client address off the gateway's host: the owner of the
limits, ``Principal.bucket``) may hold at most ``--max-log-bytes-per-key`` bytes of
stream logs in Redis at once. Each owner has a ledger of its streams whose logs are
still there, in one slot (the owner is the hash tag, :meth:`Keys.ledger`):

- ``P lb:{<owner>}``: sorted set, member = stream id, score = when its log expires
  (Redis' clock, ms);
- ``P lb:{<owner>}:b``: hash, stream id -> bytes counted for it, and field ``""`` the
  total.

A gateway creating a stream reserves its worst case first (:data:`RESERVE_LUA`:
:func:`log_bytes` of its ``max_tokens`` and ``logprobs``, at most the limit, held until
the stream's keys would expire unfinished), refused when the owner's total would pass
the limit. Whoever writes the stream's ``done`` event (its worker, or a gateway ending
it) settles the entry (:data:`SETTLE_LUA`): the bytes become the log's own size in Redis
(``MEMORY USAGE``), held until the log expires, ``stream_ttl`` after its end. Entries
whose time has passed leave the total at the owner's next reservation. The owner is in
the stream's metadata (``MetaField.LOG_OWNER``), so the writer of the end needs nothing
else. A settle that fails (Redis down) is tried again; one that never comes leaves the
reservation until the stream's own safety expiry (``ACTIVE_TTL``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenrelay.core.wire.keys import ACTIVE_TTL, Keys

__all__ = [
    "DEFAULT_MAX_LOG_BYTES",
    "RESERVE_LUA",
    "SETTLE_LUA",
    "log_bytes",
    "reserve_call",
    "settle_call",
]

DEFAULT_MAX_LOG_BYTES = "256mb"  # --max-log-bytes-per-key: a quarter of the embedded Redis

# Worst-case bytes of a log in Redis (MEMORY USAGE, listpack-encoded stream entries):
# a log's first entries take a listpack node of about 4 KiB, a token event of a short
# token with its ids 32-40 bytes more, and each of its logprob entries 25-37; these
# bounds leave room for tokens of 16 characters and more, and tool-call fields.
LOG_BYTES_FIXED = 8192  # the markers, the done event, the stream's own structure
LOG_BYTES_PER_TOKEN = 96
LOG_BYTES_PER_LOGPROB = 64  # the chosen token's and each alternative's


def log_bytes(params: Mapping[str, Any] | None, default_max_tokens: int = 256) -> int:
    """The bytes reserved for a request's log: its ``max_tokens`` tokens, each with its
    logprob and ``logprobs`` alternatives when it asks for them."""
    p = params or {}
    max_tokens = p.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        max_tokens = default_max_tokens
    top = p.get("logprobs")
    per = LOG_BYTES_PER_TOKEN
    if isinstance(top, int) and not isinstance(top, bool) and top >= 0:
        per += LOG_BYTES_PER_LOGPROB * (1 + top)
    return LOG_BYTES_FIXED + max_tokens * per


_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Both keys expire with the ledger's latest entry.
_EXPIRE = """
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if last[2] then
  redis.call('PEXPIREAT', KEYS[1], last[2])
  redis.call('PEXPIREAT', KEYS[2], last[2])
end
"""

# KEYS: the ledger, its bytes. ARGV: stream id, bytes, the limit, ms to hold them.
# Returns {1, total} when reserved, {0, total, ms until the first entry expires} when not.
RESERVE_LUA = (
    _NOW
    + """
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
local total = tonumber(redis.call('HGET', KEYS[2], '') or '0')
for _, sid in ipairs(gone) do
  total = total - tonumber(redis.call('HGET', KEYS[2], sid) or '0')
  redis.call('HDEL', KEYS[2], sid)
end
if #gone > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if total < 0 then total = 0 end
  redis.call('HSET', KEYS[2], '', total)
end
local want = tonumber(ARGV[2])
if total + want > tonumber(ARGV[3]) then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  local wait = 0
  if first[2] then wait = tonumber(first[2]) - now end
  return {0, total, wait}
end
total = total + want
redis.call('HSET', KEYS[2], ARGV[1], want, '', total)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[4]), ARGV[1])
"""
    + _EXPIRE
    + """
return {1, total}
"""
)

# KEYS: the ledger, its bytes. ARGV: stream id, its bytes now, ms to hold them.
# Returns 1, or 0 when the stream has no entry (no limit, or it expired).
SETTLE_LUA = (
    _NOW
    + """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local old = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
local new = tonumber(ARGV[2])
local total = tonumber(redis.call('HGET', KEYS[2], '') or '0') - old + new
if total < 0 then total = 0 end
redis.call('HSET', KEYS[2], ARGV[1], new, '', total)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
"""
    + _EXPIRE
    + """
return 1
"""
)


def reserve_call(
    keys: Keys, owner: str, stream_id: str, want: int, limit: int
) -> tuple[list[str], list[str]]:
    """``(KEYS, ARGV)`` of a :data:`RESERVE_LUA` call: ``want`` bytes (at most ``limit``),
    held as long as the stream's keys live unfinished."""
    hold_ms = int(ACTIVE_TTL * 1000)
    return list(keys.ledger(owner)), [stream_id, str(min(want, limit)), str(limit), str(hold_ms)]


def settle_call(
    keys: Keys, owner: str, stream_id: str, size: int, ttl_s: float
) -> tuple[list[str], list[str]]:
    """``(KEYS, ARGV)`` of a :data:`SETTLE_LUA` call: the stream's log holds ``size``
    bytes, for ``ttl_s`` more seconds (0: release the entry now)."""
    return list(keys.ledger(owner)), [stream_id, str(max(0, size)), str(int(ttl_s * 1000))]
