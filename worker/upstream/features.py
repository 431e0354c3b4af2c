"""What a relay passes on beyond sampling, and reads back from the chunks, sans I/O.

Asked for, a request's ``logprobs`` go upstream in the endpoint's own shape (chat:
``logprobs: true`` and ``top_logprobs``; completions: ``logprobs`` as the count), and
each chunk's logprobs come back as :class:`core.wire.logprobs.Logprobs`, the values the
engine worker stores on its token events: chat's ``choices[0].logprobs.content`` items
(``token``, ``logprob``, ``bytes``, ``top_logprobs``) or completions'
``choices[0].logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs`` as text ->
logprob; the chosen token's exact bytes are then its text's UTF-8). An item that is not
one (no string token, no number) is read past; a chunk's items are capped at
:data:`MAX_CHUNK_LOGPROBS` and each token's alternatives at
:data:`core.wire.params.MAX_TOP_LOGPROBS`.
"""

from __future__ import annotations

import math
from typing import Any

from tokenrelay.core.wire.logprobs import LOGPROB_FLOOR, Logprobs, TokenLogprob
from tokenrelay.core.wire.params import MAX_TOP_LOGPROBS, SamplingParams

MAX_CHUNK_LOGPROBS = 4096  # tokens' logprobs read from one chunk, at most


def logprob_fields(p: SamplingParams, chat: bool) -> dict[str, Any]:
    """The fields that ask the upstream for ``p``'s logprobs (none when not asked)."""
    if p.logprobs is None:
        return {}
    if chat:
        return {"logprobs": True, "top_logprobs": p.logprobs}
    return {"logprobs": p.logprobs}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return LOGPROB_FLOOR if math.isnan(value) else max(value, LOGPROB_FLOOR)


def _raw(token: str, raw: Any) -> bytes:
    """A token's exact bytes: the upstream's ``bytes`` when they are bytes, else its UTF-8."""
    if isinstance(raw, list) and all(type(b) is int and 0 <= b < 256 for b in raw):
        return bytes(raw)
    return token.encode("utf-8", "surrogatepass")


def _item(raw: Any) -> TokenLogprob | None:
    """A chat logprob item (``token``, ``logprob``, ``bytes``), or None when not one."""
    if not isinstance(raw, dict) or not isinstance(token := raw.get("token"), str):
        return None
    value = _number(raw.get("logprob"))
    return None if value is None else TokenLogprob(token, value, _raw(token, raw.get("bytes")))


def _chat_entry(raw: Any) -> Logprobs | None:
    chosen = _item(raw)
    if chosen is None:
        return None
    tops = raw.get("top_logprobs")
    if not isinstance(tops, list):
        return Logprobs(chosen)
    return Logprobs(chosen, tuple(t for t in map(_item, tops[:MAX_TOP_LOGPROBS]) if t))


def _completion_entries(raw: dict[str, Any]) -> list[Logprobs]:
    tokens, values, tops = raw.get("tokens"), raw.get("token_logprobs"), raw.get("top_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list):
        return []
    out = []
    for i, token in enumerate(tokens[:MAX_CHUNK_LOGPROBS]):
        value = _number(values[i]) if i < len(values) else None
        if not isinstance(token, str) or value is None:
            continue
        top_raw = tops[i] if isinstance(tops, list) and i < len(tops) else None
        top = []
        if isinstance(top_raw, dict):
            ranked = [(t, n) for t, v in top_raw.items() if (n := _number(v)) is not None]
            ranked.sort(key=lambda tn: -tn[1])
            top = [TokenLogprob(t, n, _raw(t, None)) for t, n in ranked[:MAX_TOP_LOGPROBS]]
        out.append(Logprobs(TokenLogprob(token, value, _raw(token, None)), tuple(top)))
    return out


def chunk_logprobs(raw: Any) -> list[Logprobs]:
    """The logprobs of a chunk's ``choices[0].logprobs`` (chat's or completions' shape)."""
    if not isinstance(raw, dict):
        return []
    content = raw.get("content")
    if isinstance(content, list):
        entries = map(_chat_entry, content[:MAX_CHUNK_LOGPROBS])
        return [e for e in entries if e is not None]
    return _completion_entries(raw)


def top_at_most(entries: list[Logprobs], k: int) -> list[Logprobs]:
    """``entries`` with at most ``k`` alternatives each (the request's ``top_logprobs``:
    a completions' ``top_logprobs`` also holds the chosen token past the top ``k``)."""
    return [e if len(e.top) <= k else Logprobs(e.chosen, e.top[:k]) for e in entries]
