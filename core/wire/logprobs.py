"""Token log-probabilities: their value types, their form in the stream log, and OpenAI's shapes.

A worker whose request asked for logprobs puts them on each ``token`` event
(core/wire/events.py, field ``l``): the logprobs of the tokens whose text that
event carries, and the character offset of the event's text in the completion
(so a resumed stream renders the same ``text_offset`` without the text before
it). Stored as compact JSON::

    [offset, [[chosen, [top, ...]], ...]]      each token: [text, logprob] or [text, logprob, bytes]

``text`` is the token's text (U+FFFD for a part of a character); ``bytes`` (a
list of ints) is there only when the token's exact bytes are not ``text``'s
UTF-8. Logprobs below :data:`LOGPROB_FLOOR` (``-inf``) are stored as it, as
OpenAI and vLLM send them. :func:`chat_content` and :func:`completion_logprobs`
render them the OpenAI way (the WebSocket ``token`` frame uses the chat shape).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LOGPROB_FLOOR",
    "Logprobs",
    "TokenLogprob",
    "chat_content",
    "completion_logprobs",
    "decode_logprobs",
    "encode_logprobs",
]

LOGPROB_FLOOR = -9999.0  # what -inf (and anything below) is sent as


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's text, log-probability and exact bytes."""

    token: str
    logprob: float
    raw: bytes


@dataclass(frozen=True, slots=True)
class Logprobs:
    """A generated token's logprob and the most likely tokens at its position (descending)."""

    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


def _value(x: float) -> float:
    if math.isnan(x):
        return LOGPROB_FLOOR
    return float(f"{max(x, LOGPROB_FLOOR):.7g}")


def _pack(t: TokenLogprob) -> list[Any]:
    out: list[Any] = [t.token, _value(t.logprob)]
    if t.raw != t.token.encode("utf-8", "surrogatepass"):
        out.append(list(t.raw))
    return out


_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def encode_logprobs(offset: int, entries: Sequence[Logprobs]) -> str:
    """The ``l`` field of a token event: its text's offset and its tokens' logprobs."""
    return _dumps([offset, [[_pack(e.chosen), [_pack(t) for t in e.top]] for e in entries]])


def _unpack(item: Any) -> TokenLogprob:
    token = str(item[0])
    raw = bytes(item[2]) if len(item) > 2 else token.encode("utf-8", "surrogatepass")
    return TokenLogprob(token, float(item[1]), raw)


def decode_logprobs(raw: str | None) -> tuple[int, list[Logprobs]]:
    """``(offset, entries)`` of an ``l`` field; ``(0, [])`` for none or a malformed one."""
    if not raw:
        return 0, []
    try:
        offset, rows = json.loads(raw)
        entries = [Logprobs(_unpack(c), tuple(_unpack(t) for t in top)) for c, top in rows]
        return int(offset), entries
    except (ValueError, TypeError, IndexError):
        return 0, []


def _chat_item(t: TokenLogprob) -> dict[str, Any]:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.raw)}


def chat_content(entries: Sequence[Logprobs]) -> list[dict[str, Any]]:
    """OpenAI chat ``logprobs.content`` items: token, logprob, bytes, top_logprobs."""
    return [
        {**_chat_item(e.chosen), "top_logprobs": [_chat_item(t) for t in e.top]} for e in entries
    ]


def completion_logprobs(offset: int, text: str, entries: Sequence[Logprobs]) -> dict[str, Any]:
    """OpenAI completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset.

    ``top_logprobs[i]`` maps the most likely tokens' texts to their logprobs, and
    always holds the chosen token (so up to ``logprobs + 1`` entries, as OpenAI
    documents). ``text_offset[i]`` is where token ``i`` starts in the completion
    (``offset`` is where ``text`` does), counted in characters.
    """
    end = offset + len(text)
    tokens, values, tops, offsets = [], [], [], []
    at = offset
    for e in entries:
        tokens.append(e.chosen.token)
        values.append(e.chosen.logprob)
        top = {t.token: t.logprob for t in e.top}
        top.setdefault(e.chosen.token, e.chosen.logprob)
        tops.append(top)
        offsets.append(min(at, end))
        at += len(e.chosen.token)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
