"""Incremental detokenizer: property tests against ``tokenizer.decode`` and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenrelay.engine.text.detokenizer import IncrementalDetokenizer

VOCAB = 49152
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SAMPLE_TEXT = (
    "Hello 世界! 🎉🎉 naïve café — «quotes» \U0001d518\U0001d52b 日本語 한국어 Ελληνικά\n\tend"
)


def byte_level_ids(tok: Any, data: bytes) -> list[int]:
    """One byte-level token per byte (GPT-2 byte-to-unicode alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [tok.convert_tokens_to_ids(table[b]) for b in data]


def stream(tok: Any, ids: Sequence[int], stop: Sequence[str] = ()) -> tuple[list[str], Any]:
    detok = IncrementalDetokenizer(tok, list(stop))
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    return deltas, detok


@pytest.fixture(scope="module")
def byte_ids(default_tokenizer: Any) -> list[int]:
    return sorted(set(byte_level_ids(default_tokenizer, bytes(range(256)))))


def test_text_round_trip_with_emoji_and_cjk(default_tokenizer: Any) -> None:
    ids = default_tokenizer(SAMPLE_TEXT)["input_ids"]
    deltas, _ = stream(default_tokenizer, ids)
    assert "".join(deltas) == SAMPLE_TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_is_held_until_complete(default_tokenizer: Any) -> None:
    ids = byte_level_ids(default_tokenizer, "a🎉中".encode())  # 1 + 4 + 3 byte tokens
    detok = IncrementalDetokenizer(default_tokenizer)
    deltas = [detok.add(i) for i in ids]
    assert deltas == ["a", "", "", "", "🎉", "", "", "中"]
    assert detok.flush() == ""


@PROPERTY
@given(data=st.data())
def test_random_ids_concatenate_to_decode(
    default_tokenizer: Any, byte_ids: list[int], data: Any
) -> None:
    token = st.one_of(
        st.integers(0, VOCAB - 1),
        st.sampled_from(byte_ids),  # byte-level / partial UTF-8 pieces
        st.sampled_from([0, 1, 2]),  # special tokens (skipped by decode)
    )
    ids = data.draw(st.lists(token, max_size=40))
    deltas, _ = stream(default_tokenizer, ids)
    assert "".join(deltas) == default_tokenizer.decode(ids, skip_special_tokens=True)


@PROPERTY
@given(
    text=st.text(
        alphabet=st.one_of(
            st.characters(codec="utf-8", exclude_categories=["Cs"]),
            st.sampled_from(list("🎉👍🏽中文字日本語한국어 \n")),
        ),
        max_size=40,
    )
)
def test_random_text_round_trips(default_tokenizer: Any, text: str) -> None:
    ids = default_tokenizer(text)["input_ids"]
    deltas, _ = stream(default_tokenizer, ids)
    assert "".join(deltas) == default_tokenizer.decode(ids, skip_special_tokens=True)
    assert not any(d.endswith("\ufffd") for d in deltas[:-1] if "\ufffd" not in text)


@PROPERTY
@given(data=st.data())
def test_stop_string_never_leaks(default_tokenizer: Any, data: Any) -> None:
    text = data.draw(st.sampled_from([SAMPLE_TEXT, "The quick brown fox jumps over the lazy dog."]))
    ids = default_tokenizer(text)["input_ids"]
    full = default_tokenizer.decode(ids, skip_special_tokens=True)
    start = data.draw(st.integers(0, len(full) - 1))
    stop = full[start : start + data.draw(st.integers(1, 6))]
    other = data.draw(st.text(alphabet="@#$", min_size=1, max_size=3))  # never matches
    deltas, detok = stream(default_tokenizer, ids, [other, stop])
    expected = full[: full.find(stop)]
    assert "".join(deltas) == expected
    assert detok.stopped and detok.stop_string == stop
    assert detok.text == expected


def test_stop_string_split_across_tokens(default_tokenizer: Any) -> None:
    text = "Answer: 42<END>ignored"
    ids = byte_level_ids(default_tokenizer, text.encode())  # the stop arrives byte by byte
    detok = IncrementalDetokenizer(default_tokenizer, ["<END>"])
    seen = ""
    for i in ids:
        seen += detok.add(i)
        assert "<" not in seen  # not even the stop string's first character leaks
        if detok.stopped:
            break
    assert seen == "Answer: 42"
    assert detok.add(ids[-1]) == "" and detok.flush() == ""


def test_partial_stop_is_released_when_it_does_not_complete(default_tokenizer: Any) -> None:
    ids = byte_level_ids(default_tokenizer, b"a <EN")
    detok = IncrementalDetokenizer(default_tokenizer, ["<END>"])
    assert "".join(detok.add(i) for i in ids) == "a "
    assert detok.flush() == "<EN"  # a finish that is not a stop emits what was held
    assert not detok.stopped


def test_decode_window_stays_small(default_tokenizer: Any) -> None:
    """O(new tokens): each step decodes a few recent ids, never the whole history."""

    class Recording:
        def __init__(self, tok: Any) -> None:
            self.tok, self.longest = tok, 0

        def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
            self.longest = max(self.longest, len(ids))
            return str(self.tok.decode(ids, skip_special_tokens=skip_special_tokens))

    ids = default_tokenizer(SAMPLE_TEXT * 20)["input_ids"]
    rec = Recording(default_tokenizer)
    detok = IncrementalDetokenizer(rec)
    out = "".join(detok.add(i) for i in ids) + detok.flush()
    assert out == SAMPLE_TEXT * 20
    assert len(ids) > 300 and rec.longest <= 8


def test_empty_stop_string_is_rejected(default_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(default_tokenizer, [""])
