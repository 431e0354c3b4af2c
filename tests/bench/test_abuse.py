"""bench/abuse.py's pure parts: a case's worst gap and /healthz poll, the space token."""

from __future__ import annotations

import pytest

from bench.abuse import (
    error_code,
    failed_polls,
    longest_space_token,
    tally,
    worst_gap,
    worst_latency,
)


def test_worst_gap_counts_a_gap_overlapping_the_case_whole() -> None:
    times = [0.0, 0.1, 0.2, 3.2, 3.3, 3.4, 9.0]
    assert worst_gap(times, 0.0, 0.25) == pytest.approx(3.0)  # the stall began in the case
    assert worst_gap(times, 3.0, 3.25) == pytest.approx(3.0)  # ... or before it
    assert worst_gap(times, 3.35, 3.45) == pytest.approx(5.6)  # ... or after it
    assert worst_gap(times, 0.0, 0.15) == pytest.approx(0.1)  # a stall begun after the case
    assert worst_gap(times[:2], 0.0, 0.05) == pytest.approx(0.1)


def test_worst_gap_still_open_at_the_end_counts_up_to_it() -> None:
    assert worst_gap([0.0, 0.1], 0.5, 2.6) == pytest.approx(2.5)
    assert worst_gap([], 0.0, 5.0) == 0.0


def test_worst_latency_of_the_polls_overlapping_the_case() -> None:
    polls = [(0.0, 0.01, True), (0.06, 1.56, True), (1.6, 1.61, False), (5.0, 5.02, True)]
    assert worst_latency(polls, 1.0, 1.2) == pytest.approx(1.5)  # sent before, answered in
    assert worst_latency(polls, 1.58, 1.7) == pytest.approx(0.01)
    assert worst_latency(polls, 2.0, 4.0) == 0.0
    assert failed_polls(polls, 0.0, 2.0) == 1 and failed_polls(polls, 4.0, 6.0) == 0


def test_longest_space_token_bpe_and_unigram() -> None:
    bpe = {"a": 0, "\u0120": 5, "\u0120\u0120\u0120\u0120": 9, "\u0120\u0120": 7, "\u0120a": 3}
    assert longest_space_token(bpe) == (9, 4)
    unigram = [["<unk>", 0.0], ["\u2581", -1.0], ["\u2581\u2581\u2581", -2.0], ["x", -3.0]]
    assert longest_space_token(unigram) == (2, 3)
    assert longest_space_token({"  ": 4, "\u0120\u0120": 2}) == (2, 2)  # ties: the lower id
    with pytest.raises(ValueError):
        longest_space_token({"a": 0, "": 1})


def test_error_code_and_tally() -> None:
    assert error_code({"error": {"code": "too_large", "message": "..."}}) == "too_large"
    assert error_code({"choices": []}) == error_code([1]) == error_code({"error": "x"}) == ""
    answers = ["503 overloaded"] * 3 + ["200"] * 4 + ["429 rate_limited"]
    assert tally(answers) == "4 x 200, 3 x 503 overloaded, 1 x 429 rate_limited"
