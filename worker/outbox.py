"""The streams an engine worker produces, and their events until Redis has them.

Every stream's events are kept here (seq = index) and written with
:meth:`Outbox.flush`: one pipelined round trip for all streams with new
events. Writes are compare-and-set on the offset (core/wire/scripts.py,
``APPEND_LUA``), so a refused write tells the worker exactly what happened:

- an earlier attempt whose reply was lost did land: move on;
- Redis lost acknowledged events (a crash between AOF fsyncs): write them again;
- the stream ended elsewhere (expired, or ended from outside) or another worker
  took it over (this one was presumed dead, worker/continuation.py): stop producing
  it and abort the engine request.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenrelay.core.wire.events import TOKEN, decode_event, done_fields, entry_id, token_fields
from tokenrelay.core.wire.logprobs import Logprobs, encode_logprobs
from tokenrelay.core.wire.scripts import OWNED_ELSEWHERE, AppendResult
from tokenrelay.core.wire.tool_stream import CallStream
from tokenrelay.core.wire.tools import CallDelta, Tool, ToolCall, encode_calls, encode_deltas
from tokenrelay.core.wire.vocabulary import FinishReason, ToolFormat
from tokenrelay.worker.store import Batch, WorkerStore

log = logging.getLogger("tokenrelay.worker")


@dataclass
class Active:
    """A stream this worker is producing."""

    stream_id: str
    request_id: str | None
    entry: str  # request stream entry id (acknowledged with the done event)
    detach_timeout: float
    stream_ttl: float
    events: list[list[str]] = field(default_factory=list)  # index = seq
    written: int = 0  # events[:written] are confirmed in Redis
    meta: dict[str, str] = field(default_factory=dict)  # set with the write of seq 0
    final: bool = False  # the done event is in ``events``
    in_engine: bool = False
    silent: bool = False  # ended by someone else: write nothing more
    abort_reason: FinishReason | None = None
    detached_since: float | None = None
    text_chars: int = 0  # characters of completion text in token events so far
    # logprobs of tokens whose text has not come out yet (they go with the next text)
    pending_logprobs: list[Logprobs] = field(default_factory=list)
    queue: str | None = None  # the request queue of ``entry`` (None: ``P requests``)
    tools: tuple[Tool, ...] = ()  # offered tools
    # reads the calls from the text as it comes (core/wire/tool_stream.py); None: no tools,
    # or a relay, whose upstream sends its calls read already
    calls: CallStream | None = None
    text: list[str] = field(default_factory=list)  # a continued stream's text so far
    traceparent: str | None = None  # the request entry's (--otlp-endpoint): spans' parent
    # token ids sampled since the last token event (its ``i`` field: a continuation's input)
    pending_ids: list[int] = field(default_factory=list)
    # taken over from a dead worker: the generated tokens already in the log (else None)
    continued: list[int] | None = None

    def read_calls(self, tools: tuple[Tool, ...], fmt: ToolFormat | None) -> None:
        """Offer ``tools``: their calls are read from the text in ``fmt`` (the engine's
        model's format; None: an upstream, which sends its calls read already). A
        continued stream's reader goes on from the text already in its log."""
        self.tools = tools
        self.calls = None
        if tools and fmt is not None:
            self.calls = CallStream(fmt, tools, self.stream_id)
            for piece in self.text:
                self.calls.feed(piece)

    def finish_events(
        self, reason: FinishReason, prompt_tokens: int, completion_tokens: int, message: str | None,
        relayed: Sequence[ToolCall] = (),
    ) -> list[list[str]]:  # fmt: skip
        """The events that end the stream: the ``done`` event, with the calls the text
        made when tools were offered (or an upstream's ``relayed`` calls; then a ``stop``
        is ``tool_calls``), after a last token event when the call reader still held text
        that turned out to be content."""
        out: list[list[str]] = []
        calls = None
        if relayed:
            calls = encode_calls(relayed)
            reason = FinishReason.TOOL_CALLS if reason == FinishReason.STOP else reason
        if self.calls is not None:
            last = self.calls.finish()
            if last.content or last.deltas:
                deltas = encode_deltas(last.deltas) if last.deltas else None
                out.append(token_fields("", None, [], content=last.content, calls=deltas))
            if self.calls.calls:
                calls = encode_calls(self.calls.calls)
                reason = FinishReason.TOOL_CALLS if reason == FinishReason.STOP else reason
        out.append(done_fields(reason, prompt_tokens, completion_tokens, message, calls))
        return out

    def token_event(
        self, text: str, *, with_ids: bool, relayed: Sequence[CallDelta] = ()
    ) -> list[str]:
        """The next token event: ``text``, the logprobs of the tokens whose text it carries
        (when the request asked; tokens that never add text, EOS or a stop string's, are
        left out, as OpenAI leaves them out), ``with_ids``, their token ids, and with
        tools, the content it shows and the call deltas it carries (an upstream's
        ``relayed`` deltas, read already)."""
        lp = (
            encode_logprobs(self.text_chars, self.pending_logprobs)
            if self.pending_logprobs
            else None
        )
        ids = self.pending_ids if with_ids else None
        self.pending_logprobs, self.pending_ids = [], []
        self.text_chars += len(text)
        if self.calls is None:
            return token_fields(text, lp, ids, calls=encode_deltas(relayed) if relayed else None)
        split = self.calls.feed(text)
        content = None if split.content == text else split.content
        deltas = encode_deltas(split.deltas) if split.deltas else None
        return token_fields(text, lp, ids, content=content, calls=deltas)

    @property
    def completion_events(self) -> int:
        return sum(1 for ev in self.events if ev[1] == TOKEN)


class Outbox:
    """Active streams by id, flushed to Redis in one round trip."""

    def __init__(self, store: WorkerStore, abort: Callable[[str], object]) -> None:
        self.store = store
        self._abort = abort  # stops an engine request
        self.streams: dict[str, Active] = {}
        self.finished: list[Active] = []  # done and confirmed in Redis (see take_finished)
        self.held: set[str] = set()  # streams the last flush could not write: master down

    def __len__(self) -> int:
        return len(self.streams)

    def unwritten(self) -> list[Active]:
        return [a for a in self.streams.values() if not a.silent and a.written < len(a.events)]

    def blocked(self) -> bool:
        """Whether events wait that Redis could take now: beyond those of streams whose
        master was down at the last flush, which wait without holding up the others."""
        return any(a.stream_id not in self.held for a in self.unwritten())

    def flush(self) -> None:
        """Write every stream's unconfirmed events; raises on a Redis outage (nothing lost)."""
        todo = self.unwritten()
        batches = [
            Batch(
                a.stream_id,
                a.written,
                a.events[a.written :],
                a.meta if a.written == 0 else {},
                a.stream_ttl,
                owner=self.store.worker_id,
                ack_entry=a.entry if a.final else None,
                ack_queue=a.queue,
            )
            for a in todo
        ]
        self.held = set()
        for a, res in zip(todo, self.store.flush(batches), strict=True):
            if res is None:  # its master is down (a cluster): kept for a later flush
                self.held.add(a.stream_id)
            elif res.status == 1:
                a.written = len(a.events)
            else:
                self._reconcile(a, res)
        for a in list(self.streams.values()):
            done = a.final and a.written >= len(a.events)
            if (done or a.silent) and not a.in_engine:
                del self.streams[a.stream_id]
                if done and not a.silent:
                    self.finished.append(a)

    def take_finished(self) -> list[Active]:
        """Streams whose ``done`` event Redis confirmed since the last call."""
        out, self.finished = self.finished, []
        return out

    def _reconcile(self, a: Active, res: AppendResult) -> None:
        """A write was refused: already written, lost by Redis, or ended elsewhere."""
        last = res.last_seq
        mine = 0 <= last < len(a.events) and res.top == decode_event(
            entry_id(last), dict(zip(a.events[last][0::2], a.events[last][1::2], strict=True))
        )
        if res.status in (0, -2) and mine and last >= a.written - 1:
            a.written = last + 1  # an earlier attempt did land
            return
        if res.status == 0 and last < a.written - 1:
            extra = {"stream_id": a.stream_id, "request_id": a.request_id, "from_seq": last + 1}
            log.warning("redis lost events; writing them again", extra=extra)
            a.written = last + 1
            return
        a.silent = True  # expired, ended by a gateway, or continued elsewhere: stop producing it
        if a.in_engine:
            self._abort(a.stream_id)
        extra = {"stream_id": a.stream_id, "request_id": a.request_id}
        if res.status == OWNED_ELSEWHERE:  # its request entry is the new owner's now: no ack
            log.warning("another worker took this stream over; dropping it", extra=extra)
            return
        with contextlib.suppress(Exception):
            self.store.ack([a.entry], a.queue)
        log.info("stream ended elsewhere; dropping it", extra=extra)


def hand_back(a: Active, store: WorkerStore, abort: Callable[[str], object]) -> bool:
    """Hand an unstarted stream back to the request queue; True when done.

    Its stream log is reset to ``queued`` (:meth:`WorkerStore.release`), the
    engine request is aborted and the stream goes silent here. Its request
    entry is *not* acknowledged: it stays pending under this worker's name and
    another worker claims it once this one's heartbeat is gone.
    """
    if a.final or a.silent or a.abort_reason is not None:
        return False
    extra = {"stream_id": a.stream_id, "request_id": a.request_id}
    try:
        released = a.written == 0 or store.release(a.stream_id)
    except Exception as exc:
        log.warning("could not hand a request back: %r", exc, extra=extra)
        return False
    if not released:
        return False
    abort(a.stream_id)
    a.silent = True  # write nothing more
    log.info("request handed back to the queue", extra=extra)
    return True
