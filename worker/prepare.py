"""Prompts tokenized and grammars compiled beside the engine loop, so that a long prompt
or a large schema never stalls running streams.

Tokenizing grows with the input and compiling a ``response_format`` or a required tool
call's grammar with its schema (seconds for a hostile one): run in the engine loop, a
burst of either would hold every running stream's next token for seconds. The
loop hands a request's body to :class:`Preparer` and goes on stepping; a
background thread turns the body into token ids (the chat template rendered, or
the prompt encoded) and, for a guided request (the body's :data:`GUIDED` key: its
:class:`~core.wire.response_format.ResponseFormat`), into its grammar state too (the
``guide`` callable: the engine compiles each distinct grammar once, and the ``n``
choices of a request share it), and the loop picks the result up on a later iteration.

- A small input (under :data:`INLINE_CHARS`) without a grammar is tokenized at once, in
  the caller: a millisecond at most, and its first token does not wait for a thread.
- The thread runs at a lower scheduling priority where the OS allows it
  (Linux: a nice value per thread), so on a busy CPU the engine's own threads
  win; the tokenizers library releases the GIL while it encodes, llguidance while it
  compiles.
- Results come back in completion order, one per submitted stream, each the
  token ids (and grammar state) or the exception the encoder or the compiler raised
  (``ValueError`` for a bad request). :meth:`Preparer.forget` drops a stream whose
  result is no longer wanted (cancelled, handed back, shut down).
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

from tokenrelay.core.wire.response_format import ResponseFormat

log = logging.getLogger("tokenrelay.worker")

INLINE_CHARS = 4096  # inputs up to this many characters are tokenized in the caller
THREAD_NICE = 10  # the tokenizer thread's nice value over the process (Linux)
GUIDED = "_guided"  # the body's key for its grammar's format (a key no client body has)

Encode = Callable[[dict[str, Any]], list[int]]
Guide = Callable[[ResponseFormat], Any]  # a format -> a new request's grammar state


@dataclass
class Prepared:
    """One stream's prompt: ``token_ids`` (and the ``guide`` of a guided request), or the
    ``error`` its encoding or its grammar's compile raised."""

    stream_id: str
    token_ids: list[int] | None = None
    error: BaseException | None = None
    guide: Any = None


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
    """Turns request bodies into token ids (and grammar states) on one background thread
    (see the module doc)."""

    def __init__(
        self, encode: Encode, *, guide: Guide | None = None, inline_chars: int = INLINE_CHARS
    ) -> None:
        """``guide``: makes a guided request's grammar state (``None``: the engine makes
        it when the request is added)."""
        self._encode = encode
        self._guide = guide
        self.inline_chars = inline_chars
        self._jobs: queue.SimpleQueue[tuple[str, dict[str, Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ready: list[Prepared] = []
        self._pending: set[str] = set()  # submitted, result not taken yet
        self._wake = threading.Event()  # set when a result is ready
        self._thread: threading.Thread | None = None

    def submit(self, stream_id: str, body: dict[str, Any]) -> None:
        """Tokenize ``body`` for ``stream_id``: now if it is small and has no grammar to
        compile, else on the thread."""
        with self._lock:
            self._pending.add(stream_id)
        compiles = self._guide is not None and body.get(GUIDED) is not None
        if input_chars(body) <= self.inline_chars and not compiles:
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
            token_ids = self._encode(body)
            fmt = body.get(GUIDED)
            guide = self._guide(fmt) if self._guide is not None and fmt is not None else None
            return Prepared(stream_id, token_ids=token_ids, guide=guide)
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
