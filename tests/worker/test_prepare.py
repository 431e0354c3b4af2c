"""The preparer: small inputs tokenized at once, long ones and grammars on a niced thread."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import pytest

from tokenrelay.core.wire.response_format import ResponseFormat
from tokenrelay.worker.prepare import GUIDED, INLINE_CHARS, THREAD_NICE, Preparer, input_chars


class Recorder:
    """An encoder that records the thread it ran on; ``gate`` holds long inputs until set."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.nice: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self, body: dict[str, Any]) -> list[int]:
        self.threads.append(threading.current_thread().name)
        if sys.platform == "linux":
            self.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        if input_chars(body) > INLINE_CHARS:  # only the thread's jobs wait
            self.entered.set()
            assert self.gate.wait(10)
        if body.get("prompt") == "bad":
            raise ValueError("prompt: bad")
        return [len(body.get("prompt") or "")]


def long_body(tag: str = "") -> dict[str, Any]:
    return {"prompt": tag + "x" * (INLINE_CHARS + 1)}


def test_input_chars_counts_the_prompt_or_every_message() -> None:
    assert input_chars({"prompt": "abc"}) == 3
    assert input_chars({"messages": [{"content": "ab"}, {"content": "cde"}, "junk"]}) == 5
    assert input_chars({"prompt": [1, 2, 3]}) == 0
    assert input_chars({}) == 0


def test_a_small_input_is_tokenized_in_the_caller() -> None:
    enc = Recorder()
    prep = Preparer(enc)
    prep.submit("s1", {"prompt": "hello"})
    assert enc.threads == [threading.current_thread().name]
    assert prep.pending() == 1
    (got,) = prep.take()
    assert (got.stream_id, got.token_ids, got.error) == ("s1", [5], None)
    assert prep.pending() == 0 and prep.take() == []
    assert prep._thread is None  # no thread for small inputs


def test_a_long_input_is_tokenized_on_a_lower_priority_thread() -> None:
    enc = Recorder()
    prep = Preparer(enc)
    try:
        prep.submit("s1", long_body())
        assert prep.wait(10)
        (got,) = prep.take()
        assert got.token_ids == [INLINE_CHARS + 1]
        assert enc.threads == ["tokenizer"]
        if sys.platform == "linux":
            own = os.getpriority(os.PRIO_PROCESS, 0)
            assert enc.nice == [min(19, own + THREAD_NICE)]
    finally:
        prep.close()


def test_an_encoding_error_comes_back_as_the_result() -> None:
    prep = Preparer(Recorder())
    prep.submit("s1", {"prompt": "bad"})
    (got,) = prep.take()
    assert got.token_ids is None and isinstance(got.error, ValueError)


def test_a_forgotten_stream_is_never_delivered() -> None:
    enc = Recorder()
    enc.gate.clear()
    prep = Preparer(enc)
    try:
        prep.submit("long", long_body())
        assert enc.entered.wait(10)  # the thread holds "long"
        prep.submit("queued", long_body("q"))
        prep.forget("queued")  # still queued: skipped
        prep.submit("short", {"prompt": "hi"})  # small: ready at once, ahead of "long"
        assert [p.stream_id for p in prep.take()] == ["short"]
        prep.forget("long")  # on the thread now: its result is dropped
        enc.gate.set()
        prep.submit("after", long_body("a"))
        assert prep.wait(10)
        assert [p.stream_id for p in prep.take()] == ["after"]
        assert enc.threads.count("tokenizer") == 2  # "long" and "after", not "queued"
        assert prep.pending() == 0
    finally:
        prep.close()


def test_close_stops_the_thread_and_drops_what_is_pending() -> None:
    enc = Recorder()
    enc.gate.clear()
    prep = Preparer(enc)
    prep.submit("s1", long_body())
    assert enc.entered.wait(10)
    prep.close()
    enc.gate.set()
    assert prep._thread is not None
    prep._thread.join(10)
    assert not prep._thread.is_alive()
    assert prep.take() == [] and prep.pending() == 0


@pytest.mark.parametrize("chars", [0, INLINE_CHARS])
def test_the_inline_threshold_is_inclusive(chars: int) -> None:
    enc = Recorder()
    prep = Preparer(enc)
    prep.submit("s", {"prompt": "y" * chars})
    assert enc.threads == [threading.current_thread().name]


class Guides:
    """A ``guide`` callable that records the thread it ran on and the formats it got."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.formats: list[ResponseFormat] = []

    def __call__(self, fmt: ResponseFormat) -> Any:
        self.threads.append(threading.current_thread().name)
        self.formats.append(fmt)
        if fmt.type == "json_schema" and fmt.schema == "bad":
            raise ValueError("response_format: refused")
        return ("guide", fmt.key)


def test_a_guided_request_compiles_on_the_thread_even_when_small() -> None:
    enc, guides = Recorder(), Guides()
    prep = Preparer(enc, guide=guides)
    fmt = ResponseFormat("json_object")
    try:
        prep.submit("g", {"prompt": "hi", GUIDED: fmt})
        assert prep.wait(10)
        (got,) = prep.take()
        assert (got.token_ids, got.guide, got.error) == ([2], ("guide", fmt.key), None)
        assert guides.threads == ["tokenizer"] and guides.formats == [fmt]
        assert enc.threads == ["tokenizer"]  # the caller (the step loop) did neither
        prep.submit("free", {"prompt": "hi"})  # no grammar: still at once, in the caller
        (free,) = prep.take()
        assert free.guide is None and enc.threads[-1] == threading.current_thread().name
    finally:
        prep.close()


def test_a_refused_grammar_comes_back_as_the_result() -> None:
    prep = Preparer(Recorder(), guide=Guides())
    try:
        prep.submit("g", {"prompt": "hi", GUIDED: ResponseFormat("json_schema", "bad")})
        assert prep.wait(10)
        (got,) = prep.take()
        assert got.token_ids is None and got.guide is None
        assert isinstance(got.error, ValueError) and "refused" in str(got.error)
    finally:
        prep.close()


def test_without_a_guide_callable_a_guided_body_is_only_tokenized() -> None:
    enc = Recorder()
    prep = Preparer(enc)  # an engine that makes its grammar state itself
    prep.submit("g", {"prompt": "hi", GUIDED: ResponseFormat("json_object")})
    (got,) = prep.take()
    assert got.token_ids == [2] and got.guide is None
    assert enc.threads == [threading.current_thread().name]
