"""What the upstream calls produced, handed from their HTTP thread to the worker loop.

The calls run on an asyncio loop in a thread of their own (worker/upstream/engine.py);
the worker loop drives the engine from its thread. They meet here, under one lock:

- a call *opens* when its first text arrives (or it finishes without text): the
  loop's Intake takes it (:meth:`Inbox.take_opened`), writes ``accepted`` and
  attaches it (:meth:`Inbox.attach`); a call that fails before that comes out
  of :meth:`Inbox.take_opened` with its refusal instead;
- an attached call's text deltas (with their tokens' logprobs and the tool-call deltas
  that came with them), then its finish (with its calls), come out of
  :meth:`Inbox.drain` as the step outputs the worker writes, in arrival order;
- :meth:`Inbox.abort` ends a call from the loop's side: an attached one reports
  a finish ``abort`` at the next drain (the worker names it ``cancelled`` or
  ``expired``), as our engine does.

A condition variable wakes the worker loop when anything arrives, so a step
returns as soon as there is text and waits only while there is none.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenrelay.core.wire.logprobs import Logprobs
from tokenrelay.core.wire.tools import CallDelta, ToolCall
from tokenrelay.core.wire.vocabulary import ErrorCode, FinishReason
from tokenrelay.worker.errors import EngineRefused
from tokenrelay.worker.prepare import Prepared

OPENING, OPEN, ATTACHED = "opening", "open", "attached"


@dataclass
class Output:
    """One call's news in one step (a :class:`worker.engine_client.StepOutput`).

    ``new_token_ids`` has one placeholder (-1) per streamed chunk: an upstream
    does not say its token ids, and the worker only counts them (telemetry).
    """

    request_id: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    message: str | None = None  # why, for finish_reason "error"
    new_logprobs: Sequence[Logprobs] | None = None
    upstream_ttft: float | None = None  # the first output's: upstream request to first text
    new_calls: list[CallDelta] | None = None  # tool-call deltas (worker/upstream/features.py)
    tool_calls: tuple[ToolCall, ...] = ()  # the finished answer's calls


@dataclass
class CallState:
    """One call as the inbox keeps it."""

    stream_id: str
    phase: str = OPENING
    text: list[str] = field(default_factory=list)  # deltas not yet drained
    logprobs: list[Logprobs] = field(default_factory=list)  # theirs, when asked for
    deltas: list[CallDelta] = field(default_factory=list)  # tool-call deltas not yet drained
    calls: tuple[ToolCall, ...] = ()  # the answer's calls, at the finish
    chunks: int = 0  # chunks not yet drained
    finish: tuple[FinishReason, str | None] | None = None  # (reason, message)
    usage: tuple[int, int] | None = None  # (prompt, completion) at the finish
    refusal: EngineRefused | None = None
    total_chunks: int = 0
    upstream_ttft: float | None = None  # seconds, until the first output reports it

    @property
    def news(self) -> bool:
        return bool(self.text) or bool(self.deltas) or self.finish is not None


class Inbox:
    """Calls by stream id, and the condition that wakes the worker loop."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._calls: dict[str, CallState] = {}
        self._opened: list[str] = []  # opened or refused, not yet taken
        self._dirty = False  # an attached call has news

    # --- the HTTP thread's side -------------------------------------------------------

    def add(self, stream_id: str) -> bool:
        """A call starts; False when one with this id is already known."""
        with self._cond:
            if stream_id in self._calls:
                return False
            self._calls[stream_id] = CallState(stream_id)
            return True

    def text(
        self,
        stream_id: str,
        delta: str,
        upstream_ttft: float | None = None,
        logprobs: Sequence[Logprobs] = (),
        deltas: Sequence[CallDelta] = (),
    ) -> None:
        """A text delta (the first with the seconds from the upstream request to it), the
        logprobs of its tokens and the tool-call deltas that came with it."""
        with self._cond:
            st = self._calls.get(stream_id)
            if st is None or st.finish is not None:
                return
            if upstream_ttft is not None and st.total_chunks == 0:
                st.upstream_ttft = upstream_ttft
            st.text.append(delta)
            st.logprobs.extend(logprobs)
            st.deltas.extend(deltas)
            st.chunks += 1
            st.total_chunks += 1
            self._news(st)

    def finish(
        self,
        stream_id: str,
        reason: FinishReason,
        message: str | None,
        usage: tuple[int, int] | None,
        calls: tuple[ToolCall, ...] = (),
    ) -> None:
        with self._cond:
            st = self._calls.get(stream_id)
            if st is None or st.finish is not None:
                return
            st.finish = (reason, message)
            st.usage, st.calls = usage, calls
            self._news(st)

    def refuse(self, stream_id: str, code: ErrorCode, message: str) -> None:
        """The call failed before its first token: the stream is refused with ``code``."""
        with self._cond:
            st = self._calls.get(stream_id)
            if st is None or st.phase != OPENING:
                return
            st.refusal = EngineRefused(code, message)
            self._opened.append(stream_id)
            self._cond.notify_all()

    def _news(self, st: CallState) -> None:
        if st.phase == OPENING:
            st.phase = OPEN
            self._opened.append(st.stream_id)
        elif st.phase == ATTACHED:
            self._dirty = True
        self._cond.notify_all()

    # --- the worker loop's side ----------------------------------------------------------

    def take_opened(self) -> list[Prepared]:
        """Calls opened (or refused) since the last call; refused ones are forgotten."""
        with self._cond:
            out = []
            for sid in self._opened:
                st = self._calls.get(sid)
                if st is None:
                    continue
                if st.refusal is not None:
                    del self._calls[sid]
                    out.append(Prepared(sid, error=st.refusal))
                else:
                    out.append(Prepared(sid))
            self._opened = []
            return out

    def attach(self, stream_id: str) -> int:
        """An opened call joins the steps; its prompt tokens when known (else 0)."""
        with self._cond:
            st = self._calls.get(stream_id)
            if st is None or st.phase != OPEN:
                raise ValueError(f"no opened upstream call {stream_id!r}")
            st.phase = ATTACHED
            self._dirty = True
            return st.usage[0] if st.usage else 0

    def abort(self, stream_id: str) -> bool:
        """End a call from the loop's side; False when unknown. An attached one reports
        ``abort`` at the next drain; any other is forgotten."""
        with self._cond:
            st = self._calls.get(stream_id)
            if st is None:
                return False
            if st.phase != ATTACHED:
                del self._calls[stream_id]
                return True
            if st.finish is None or st.finish[0] != FinishReason.CANCELLED:
                st.finish = (FinishReason.CANCELLED, None)
                st.text.clear()
                st.logprobs.clear()
                st.deltas.clear()
                self._dirty = True
                self._cond.notify_all()
            return True

    def drain(self, timeout: float) -> list[Output]:
        """The attached calls' news, waiting up to ``timeout`` seconds for some."""
        with self._cond:
            if not self._dirty and not self._opened and timeout > 0:
                self._cond.wait(timeout)
            if not self._dirty:
                return []
            self._dirty = False
            out = []
            for st in list(self._calls.values()):
                if st.phase == ATTACHED and st.news:
                    out.append(self._output(st))
            return out

    def _output(self, st: CallState) -> Output:
        text, st.text = "".join(st.text), []
        ids, st.chunks = [-1] * st.chunks, 0
        ttft, st.upstream_ttft = st.upstream_ttft, None
        lps, st.logprobs = st.logprobs or None, []
        deltas, st.deltas = st.deltas or None, []
        if st.finish is None:
            return Output(st.stream_id, text, ids, False, None, 0, st.total_chunks,
                          new_logprobs=lps, upstream_ttft=ttft, new_calls=deltas)  # fmt: skip
        del self._calls[st.stream_id]
        reason, message = st.finish
        prompt, completion = st.usage if st.usage else (0, st.total_chunks)
        return Output(st.stream_id, text, ids, True, reason, prompt, completion, message,
                      new_logprobs=lps, upstream_ttft=ttft, new_calls=deltas,
                      tool_calls=st.calls)  # fmt: skip

    def wait_opened(self, timeout: float) -> bool:
        """Block until a call has opened or been refused (True), or ``timeout`` passes."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._opened), timeout)

    def phase(self, stream_id: str) -> str | None:
        with self._cond:
            st = self._calls.get(stream_id)
            return None if st is None else st.phase

    def phases(self) -> dict[str, str]:
        """Every call's phase, by stream id."""
        with self._cond:
            return {sid: st.phase for sid, st in self._calls.items()}

    def counts(self) -> dict[str, int]:
        """Calls by phase (opening, open, attached)."""
        with self._cond:
            out = dict.fromkeys((OPENING, OPEN, ATTACHED), 0)
            for st in self._calls.values():
                out[st.phase] += 1
            return out

    def has_attached(self) -> bool:
        with self._cond:
            return any(st.phase == ATTACHED for st in self._calls.values())
