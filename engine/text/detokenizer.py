"""Incremental detokenization with stop strings.

Each :meth:`IncrementalDetokenizer.add` decodes only a short window of recent
ids (the vLLM/TGI ``prefix_offset``/``read_offset`` scheme), so a step costs
O(new tokens), not O(all tokens). Text whose last character is still
incomplete (a multi-byte UTF-8 character split across byte-fallback or
byte-level tokens decodes to U+FFFD) is held back until it completes; and text
that could still be the beginning of a stop string is held back until it is
known not to be one. Concatenated deltas plus :meth:`flush` equal
``tokenizer.decode(all_ids, skip_special_tokens=True)`` when no stop string hit;
when one hits, the text ends right before it. The special tokens in ``keep`` (a tool-call
format's markers, core/wire/tool_formats.py) are the exception: their text is kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer (transformers' or ``tokenizers``')."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, honouring stop strings."""

    def __init__(
        self, tokenizer: Decoder, stop: Iterable[str] = (), keep: Mapping[int, str] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.keep = dict(keep or {})  # special token id -> its text, shown all the same
        self.stop = [s for s in stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop: stop strings must be non-empty strings")
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self._prefix_offset = 0  # window start: decoded for context only
        self._read_offset = 0  # ids before this are already turned into text
        self._pending = ""  # decoded text held back (possible stop-string start)
        self._parts: list[str] = []  # emitted deltas
        self.stopped = False  # a stop string was found; nothing more is emitted
        self.stop_string: str | None = None  # which one

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._parts)

    def add(self, token_id: int) -> str:
        """Append one id; return the new text that is safe to stream (maybe ``""``)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        kept = self.keep.get(token_id)
        if kept is not None:  # what came before it is final, then the token's own text
            return self._emit(self._decode_new(final=True) + kept, final=False)
        return self._emit(self._decode_new(final=False), final=False)

    def add_many(self, token_ids: Iterable[int]) -> str:
        """Append several ids; return the combined delta."""
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """At a finish that is not a stop string: emit everything held back."""
        if self.stopped:
            return ""
        return self._emit(self._decode_new(final=True), final=True)

    def _decode_new(self, *, final: bool) -> str:
        """Text of the ids after ``read_offset``, or ``""`` while it ends mid-character."""
        ids = self.ids
        if self._read_offset >= len(ids):
            return ""
        prefix = self.tokenizer.decode(
            ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full = self.tokenizer.decode(ids[self._prefix_offset :], skip_special_tokens=True)
        if not final and (len(full) <= len(prefix) or full.endswith(REPLACEMENT)):
            return ""  # nothing new yet, or an incomplete character at the end
        if not full.startswith(prefix):  # a decoder that rewrites context: re-anchor
            prefix = ""
            full = self.tokenizer.decode(ids[self._read_offset :], skip_special_tokens=True)
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return full[len(prefix) :]

    def _emit(self, new: str, *, final: bool) -> str:
        if not new and not (final and self._pending):
            return ""
        text = self._pending + new
        self._pending = ""
        if self.stop:
            cut = _first_stop(text, self.stop)
            if cut is not None:
                pos, self.stop_string = cut
                self.stopped = True
                return self._out(text[:pos])
            if not final:
                keep = _partial_stop_len(text, self.stop, self._max_stop)
                if keep:
                    text, self._pending = text[:-keep], text[-keep:]
        return self._out(text)

    def _out(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
        return delta


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Earliest position of any stop string in ``text`` (and which one)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def _partial_stop_len(text: str, stops: list[str], max_len: int) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    for n in range(min(len(text), max_len - 1), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0
