"""gateway/streams/readers.py: the cap on resumes per stream, and who gives way (no I/O)."""

from __future__ import annotations

import pytest

from tokenrelay.gateway.errors import Overloaded, TooManyReaders, refusal
from tokenrelay.gateway.state import Settings
from tokenrelay.gateway.streams.readers import REPLACE_AFTER, StreamReaders


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_full_stream_refuses_young_readers_with_the_wait_until_one_may_go() -> None:
    clock = Clock()
    readers = StreamReaders(2, clock=clock)
    ended: list[str] = []
    a = readers.take("S", lambda: ended.append("a"))
    clock.now += 0.5
    readers.take("S", lambda: ended.append("b"))
    readers.take("T", lambda: ended.append("t"))  # another stream: its own seats
    with pytest.raises(TooManyReaders) as info:
        readers.take("S", lambda: ended.append("c"))
    assert isinstance(info.value, Overloaded)
    assert info.value.retry_after == pytest.approx(REPLACE_AFTER - 0.5)
    r = refusal(info.value)
    assert r.code == "overloaded" and r.retry_after == pytest.approx(REPLACE_AFTER - 0.5)
    assert "at most 2" in r.message
    assert readers.count("S") == 2 and not ended and a.held


def test_a_new_resume_replaces_the_oldest_reader_once_it_has_read_a_while() -> None:
    clock = Clock()
    readers = StreamReaders(2, clock=clock)
    ended: list[str] = []
    a = readers.take("S", lambda: ended.append("a"))
    b = readers.take("S", lambda: ended.append("b"))
    clock.now += REPLACE_AFTER
    c = readers.take("S", lambda: ended.append("c"))
    assert ended == ["a"] and a.replaced and not a.held
    assert not b.replaced and c.held and readers.count("S") == 2 and readers.replaced == 1
    readers.leave(a)  # the replaced reader's own cleanup: nothing more happens
    assert readers.count("S") == 2
    readers.leave(b)
    readers.leave(b)  # idempotent
    readers.leave(c)
    assert readers.count("S") == 0 and not readers._seats  # nothing kept per stream


def test_a_replaced_reader_that_fails_to_end_never_keeps_the_new_one_out() -> None:
    clock = Clock()
    readers = StreamReaders(1, replace_after=0, clock=clock)

    def broken() -> None:
        raise RuntimeError("boom")

    readers.take("S", broken)
    assert readers.take("S", lambda: None).held


@pytest.mark.parametrize("limit", [0, -1, True, 1.5])
def test_the_cap_is_a_positive_integer(limit: object) -> None:
    with pytest.raises(ValueError, match="--max-resumes-per-stream"):
        StreamReaders(limit)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--max-resumes-per-stream"):
        Settings(redis_url="redis://127.0.0.1:1/0", max_resumes_per_stream=limit)  # type: ignore[arg-type]


def test_the_flag_reaches_the_settings() -> None:
    from tokenrelay.core.cli import build_parser

    args = build_parser().parse_args(
        ["gateway", "--redis-url", "redis://127.0.0.1:1/0", "--max-resumes-per-stream", "7"]
    )
    assert Settings.from_args(args).max_resumes_per_stream == 7
    args = build_parser().parse_args(["serve"])
    assert args.max_resumes_per_stream == 4
