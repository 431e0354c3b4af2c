"""Prompts tokenized beside the engine loop, so a long one never stalls running streams.

Tokenizing is the one per-request cost that grows with the input, and a burst of
very long prompts run in the engine loop would hold every running stream's next
token for seconds. The
loop hands a request's body to :class:`Preparer` and goes on stepping; a
background thread turns the body into token ids (the chat template rendered, or
the prompt encoded) and the loop picks the result up on a later iteration.

- A small input (under :data:`INLINE_CHARS`) is tokenized at once, in the
  caller: a millisecond at most, and its first token does not wait for a thread.
- The thread runs at a lower scheduling priority where the OS allows it
  (Linux: a nice value per thread), so on a busy CPU the engine's own threads
  win; the tokenizers library releases the GIL while it encodes.
- Results come back in completion order, one per submitted stream, each the
  token ids or the exception the encoder raised (``ValueError`` for a bad
  request). :meth:`Preparer.forget` drops a stream whose result is no longer
  wanted (cancelled, handed back, shut down).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("tokenrelay.worker")

INLINE_CHARS = 4096  # inputs up to this many characters are tokenized in the caller
THREAD_NICE = 10  # the tokenizer thread's nice value over the process (Linux)

Encode = Callable[[dict[str, Any]], list[int]]


@dataclass
class Prepared:
    """One stream's prompt: ``token_ids``, or the ``error`` its encoding raised."""

    stream_id: str
    token_ids: list[int] | None = None
    error: BaseException | None = None


def input_chars(body: dict[str, Any]) -> int:
    """Characters of text a request body carries (prompt, or all message contents)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    total = 0
    for msg in body.get("messages") or ():
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            total += len(content)
    return total


class Preparer:
    """Turns request bodies into token ids on one background thread (see the module doc)."""

    def __init__(self, encode: Encode, *, inline_chars: int = INLINE_CHARS) -> None:
        self._encode = encode
        self.inline_chars = inline_chars
        self._jobs: queue.SimpleQueue[tuple[str, dict[str, Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ready: list[Prepared] = []
        self._pending: set[str] = set()  # submitted, result not taken yet
        self._wake = threading.Event()  # set when a result is ready
        self._thread: threading.Thread | None = None

    def submit(self, stream_id: str, body: dict[str, Any]) -> None:
        """Tokenize ``body`` for ``stream_id``: now if it is small, else on the thread."""
        with self._lock:
            self._pending.add(stream_id)
        if input_chars(body) <= self.inline_chars:
            self._finish(self._run(stream_id, body))
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tokenizer", daemon=True)
            self._thread.start()
        self._jobs.put((stream_id, body))

    def take(self) -> list[Prepared]:
        """The results ready since the last call (forgotten streams left out)."""
        with self._lock:
            out, self._ready = self._ready, []
            self._wake.clear()
            for item in out:
                self._pending.discard(item.stream_id)
        return out

    def forget(self, stream_id: str) -> None:
        """Drop ``stream_id``'s result, ready or to come."""
        with self._lock:
            self._pending.discard(stream_id)
            self._ready = [p for p in self._ready if p.stream_id != stream_id]

    def pending(self) -> int:
        """Streams submitted whose result has not been taken."""
        with self._lock:
            return len(self._pending)

    def wait(self, timeout: float) -> bool:
        """Block until a result is ready (True) or ``timeout`` seconds pass."""
        return self._wake.wait(timeout)

    def close(self) -> None:
        """Stop the thread after the job it is on (results no longer wanted)."""
        with self._lock:
            self._pending.clear()
            self._ready = []
        if self._thread is not None:
            self._jobs.put(None)

    # --- the thread --------------------------------------------------------------------

    def _run(self, stream_id: str, body: dict[str, Any]) -> Prepared:
        try:
            return Prepared(stream_id, token_ids=self._encode(body))
        except Exception as exc:  # the loop turns it into the stream's error
            return Prepared(stream_id, error=exc)

    def _finish(self, result: Prepared) -> None:
        with self._lock:
            if result.stream_id in self._pending:
                self._ready.append(result)
                self._wake.set()

    def _loop(self) -> None:
        with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _nicer())
        while True:
            job = self._jobs.get()
            if job is None:
                return
            stream_id, body = job
            with self._lock:
                wanted = stream_id in self._pending
            if wanted:
                self._finish(self._run(stream_id, body))


def _nicer() -> int:
    """The tokenizer thread's priority: :data:`THREAD_NICE` above the process's own."""
    return min(19, os.getpriority(os.PRIO_PROCESS, 0) + THREAD_NICE)
