"""llguidance's verdict on a JSON schema: computed once per schema, cached, and deferrable.

The last check of a schema (core/wire/response_format.py) asks llguidance whether it can
compile it, without a tokenizer. That costs from microseconds to seconds (it grows with
the schema's ``format`` and ``pattern`` keywords), holds no lock on the GIL (llguidance
releases it) and always gives the same answer for the same schema. So:

* **once**: :data:`VERDICTS`, a bounded LRU shared by every request of the process, keeps
  each verdict (``""``: it compiles; else llguidance's first line of refusal) under the
  SHA-256 of the schema's compact JSON text (:func:`schema_key`), for the schemas that
  pass and those that fail alike;
* **off the event loop**: inside :func:`deferred_verdicts`, a verdict that is not cached
  yet is not computed: the check records a :class:`PendingVerdict` and passes, and the
  caller computes the recorded ones elsewhere and refuses the request if one fails. The
  gateway defers while it validates a request on its event loop, then awaits the
  verdicts from a small thread pool (gateway/access/schema_pool.py); a worker defers
  when it re-reads a request's parameters (its engine compiles the grammar for real, on
  the preparer thread).

Outside :func:`deferred_verdicts`, :func:`verdict` computes a missing verdict in the
caller's thread (the offline engine API, tests).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_VERDICT_CACHE",
    "GRAMMAR_OPTIONS",
    "VERDICTS",
    "PendingVerdict",
    "VerdictCache",
    "compute_verdict",
    "deferred_verdicts",
    "llguidance_verdict",
    "schema_key",
    "verdict",
]

DEFAULT_VERDICT_CACHE = 4096  # verdicts kept (a key and a line of text each)

# The JSON a guided output is: compact, on one line, ", " and ": " as separators (no run of
# whitespace a small model could get lost in). llguidance's JSON compile options.
GRAMMAR_OPTIONS: Any = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def schema_key(text: str) -> str:
    """The cache key of a schema's compact JSON text: its SHA-256, hex."""
    return hashlib.sha256(text.encode()).hexdigest()


class VerdictCache:
    """A thread-safe LRU of schema key -> verdict (``""``: compiles; else why not)."""

    def __init__(self, size: int = DEFAULT_VERDICT_CACHE) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"VerdictCache size must be an integer >= 1, got {size!r}")
        self.size = size
        self._items: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> str | None:
        """The cached verdict of ``key`` (``None``: not known)."""
        with self._lock:
            found = self._items.get(key)
            if found is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return found

    def put(self, key: str, verdict: str) -> None:
        """Keep ``verdict`` for ``key``, dropping the least recently used beyond ``size``."""
        with self._lock:
            self._items[key] = verdict
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def info(self) -> dict[str, int]:
        """Entries, hits and misses."""
        with self._lock:
            return {"entries": len(self._items), "hits": self.hits, "misses": self.misses}


VERDICTS = VerdictCache()


@dataclass(frozen=True)
class PendingVerdict:
    """A schema whose verdict was deferred: its ``key``, compact JSON ``text`` and the
    request ``field`` a refusal names."""

    key: str
    text: str
    field: str


_DEFERRED: contextvars.ContextVar[list[PendingVerdict] | None] = contextvars.ContextVar(
    "tokenrelay_deferred_verdicts", default=None
)


@contextlib.contextmanager
def deferred_verdicts() -> Iterator[list[PendingVerdict]]:
    """Within the block, uncached verdicts are recorded (in order, each schema once) in the
    list this yields instead of being computed, and their checks pass."""
    pending: list[PendingVerdict] = []
    token = _DEFERRED.set(pending)
    try:
        yield pending
    finally:
        _DEFERRED.reset(token)


def llguidance_verdict(text: str) -> str:
    """llguidance's own verdict on a schema's JSON text, without a tokenizer (the costly
    part, uncached): ``""`` when it compiles, else the first line of its refusal."""
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a runtime dependency; the engine checks again
        return ""
    matcher_cls = llguidance.LLMatcher
    try:
        grammar = matcher_cls.grammar_from_json_schema(text, overrides=GRAMMAR_OPTIONS)
        error = matcher_cls.validate_grammar(grammar, None)
    except ValueError as exc:
        error = str(exc)
    if not error:
        return ""
    lines = error.strip().splitlines()
    return lines[0] if lines else "refused"


def compute_verdict(key: str, text: str) -> str:
    """The verdict of ``text`` (its key ``key``): cached, else computed now and cached."""
    found = VERDICTS.get(key)
    if found is None:
        found = llguidance_verdict(text)
        VERDICTS.put(key, found)
    return found


def verdict(text: str, field: str) -> str:
    """The verdict of a schema's compact JSON ``text``: cached, else deferred (inside
    :func:`deferred_verdicts`: ``""`` now, recorded with ``field``), else computed."""
    key = schema_key(text)
    found = VERDICTS.get(key)
    if found is not None:
        return found
    pending = _DEFERRED.get()
    if pending is None:
        return compute_verdict(key, text)
    if all(p.key != key for p in pending):
        pending.append(PendingVerdict(key, text, field))
    return ""
