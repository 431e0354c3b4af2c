"""Each token id's own text and exact bytes, for logprobs (torch-free).

OpenAI's logprobs show every token by itself: its text and its UTF-8 bytes (a
character split over several tokens shows U+FFFD in each part's text, while
the parts' bytes join into it). Decoding one id alone cannot give those bytes
back, so they are read off the vocabulary:

- byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen): each character of a token
  stands for one byte (the GPT-2 byte-to-unicode table);
- SentencePiece-style (Llama 2, Mistral): ``<0xAB>`` byte-fallback tokens are
  that byte, ``▁`` is a space;
- added and special tokens (``<|im_end|>``): their content.

Anything else falls back to ``decode([id])``. Results are cached per id.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["TokenTexts", "byte_level_table"]

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte -> the byte."""
    visible = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(visible)
    extra = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(visible, chars, strict=True)}


def _decoder_kind(tokenizer: Any) -> str:
    """``byte_level``, ``sentencepiece`` or ``other``, from the fast tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = repr(getattr(backend, "decoder", None))
    if decoder.startswith("ByteLevel"):
        return "byte_level"
    if "ByteFallback" in decoder or "Metaspace" in decoder or "\u2581" in decoder:
        return "sentencepiece"
    return "other"


class TokenTexts:
    """``texts(token_id)`` -> ``(text, bytes)`` of one token of ``tokenizer``'s vocabulary."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.kind = _decoder_kind(tokenizer)
        self._bytes_of = byte_level_table() if self.kind == "byte_level" else {}
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", "replace"), raw)
        return hit

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self.kind == "byte_level" and all(c in self._bytes_of for c in piece):
                return bytes(self._bytes_of[c] for c in piece)
            if self.kind == "sentencepiece":
                if m := _BYTE_FALLBACK.fullmatch(piece):
                    return bytes([int(m.group(1), 16)])
                return piece.replace("\u2581", " ").encode("utf-8")
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return str(text).encode("utf-8")
