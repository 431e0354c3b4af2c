"""worker/continuation.py: what a stream log says about continuing it on another worker."""

from __future__ import annotations

import pytest

from tokenrelay.core.wire.events import accepted_fields, done_fields, token_fields
from tokenrelay.core.wire.keys import DEAD_AFTER_ENV, worker_dead_after
from tokenrelay.core.wire.vocabulary import FinishReason
from tokenrelay.worker.continuation import MAX_TAKEOVERS, Continuation, plan


def log(*events: list[str]) -> list[tuple[int, list[str]]]:
    return list(enumerate(events))


def test_a_running_log_gives_its_tokens_and_text() -> None:
    found = plan(
        log(
            accepted_fields(5, "w1"),
            token_fields("Hel", None, [10, 11]),
            token_fields("lo", '{"o":3}', [12]),
            token_fields("", None, []),  # an event may carry no token
        ),
        1,
    )
    assert isinstance(found, Continuation)
    assert found.token_ids == [10, 11, 12]
    assert found.text == ["Hel", "lo", ""] and found.text_chars == 5
    assert len(found.events) == 4 and found.takeovers == 1


def test_only_the_accepted_marker_continues_from_nothing() -> None:
    found = plan(log(accepted_fields(5, "w1")), 1)
    assert isinstance(found, Continuation) and found.token_ids == [] and len(found.events) == 1


def test_what_cannot_continue_says_why() -> None:
    old = plan(log(accepted_fields(5, "w1"), token_fields("a")), 1)  # written before ids
    assert isinstance(old, str) and "token ids" in old
    bad = plan(log(accepted_fields(5, "w1"), [*token_fields("a", None, None), "i", "x y"]), 1)
    assert isinstance(bad, str) and "malformed" in bad
    gap = plan([(0, accepted_fields(5, "w1")), (2, token_fields("a", None, [1]))], 1)
    assert isinstance(gap, str) and "gap" in gap
    assert plan([], 1) == "its log is empty"
    done = log(accepted_fields(5, "w1"), done_fields(FinishReason.STOP, 5, 0))
    assert plan(done, 1) == "done"


def test_a_stream_that_keeps_killing_workers_is_not_continued_again() -> None:
    entries = log(accepted_fields(5, "w1"), token_fields("a", None, [1]))
    assert isinstance(plan(entries, MAX_TAKEOVERS), Continuation)
    poison = plan(entries, MAX_TAKEOVERS + 1)
    assert isinstance(poison, str) and "stopped" in poison and str(MAX_TAKEOVERS + 1) in poison


def test_the_dead_after_setting_is_checked() -> None:
    assert worker_dead_after({}) == 3.0
    assert worker_dead_after({DEAD_AFTER_ENV: "1.5"}) == 1.5
    for bad in ("soon", "0.5", "1e9", "nan"):
        with pytest.raises(ValueError, match=DEAD_AFTER_ENV):
            worker_dead_after({DEAD_AFTER_ENV: bad})
