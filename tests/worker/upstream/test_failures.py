"""Backoff between attempts before a call's first token, and Retry-After."""

from __future__ import annotations

import email.utils
import random

import pytest

from tokenrelay.worker.upstream.failures import MAX_RETRY_AFTER, RetryPolicy, parse_retry_after


def test_retry_after_takes_seconds_or_an_http_date() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after("-4") == 0.0
    date = email.utils.formatdate(1_000_010.0, usegmt=True)
    assert parse_retry_after(date, now=1_000_000.0) == pytest.approx(10.0)
    for bad in (None, "", "soon", "nan", "inf"):
        assert parse_retry_after(bad) is None


def test_delays_double_with_jitter_and_run_out() -> None:
    policy = RetryPolicy(max_attempts=4, first=0.25, cap=2.0, rng=random.Random(1))
    delays = [policy.next_delay() for _ in range(4)]
    assert delays[3] is None
    for got, base in zip(delays[:3], (0.25, 0.5, 1.0), strict=True):
        assert got is not None and 0.8 * base <= got <= 1.2 * base


def test_retry_after_is_honoured_up_to_a_cap() -> None:
    policy = RetryPolicy(rng=random.Random(1))
    assert policy.next_delay(retry_after=3.0) == 3.0
    assert policy.next_delay(retry_after=3600.0) == MAX_RETRY_AFTER
