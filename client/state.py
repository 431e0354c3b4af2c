"""One stream's client side, sans I/O: the resume state machine of the Python client.

:class:`StreamState` holds what a client keeps of a stream (its id, resume token, the
last ``seq`` it holds, the text, the outcome) and decides what to send. Its inputs are
the socket events of docs/protocol.md's client rule of thumb:

- :meth:`StreamState.attach`: a socket is open for the stream; the frames to send on it
  (the ``generate`` again when no ``started`` came yet, else a ``resume`` after the last
  seq; a pending ``cancel`` after it);
- :meth:`StreamState.detach`: that socket is gone (the stream is attached again later);
- :meth:`StreamState.receive`: a server frame about the stream, which yields
  :class:`Send` (a ``resume`` to fill a gap, a ``cancel`` once ``started`` names the
  stream) and :class:`Retry` (a retryable refusal: attach again after a delay) actions;
- :meth:`StreamState.cancel`: the user asked to stop generating.

Every token is delivered once, in seq order: a repeated seq is dropped, a gap asks for a
replay from the last seq instead of skipping, so a call's argument fragments add up once
each into :attr:`StreamState.tool_calls`. Nothing here touches a socket or a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenrelay.client.errors import TokenRelayError, error_for
from tokenrelay.client.frames import (
    Done,
    ErrorFrame,
    Resumed,
    ServerFrame,
    Started,
    Token,
    ToolCallDelta,
    Usage,
    cancel_frame,
    resume_frame,
)
from tokenrelay.client.retry import RETRYABLE_CODES, RetryPolicy
from tokenrelay.core.wire.vocabulary import ErrorCode, FinishReason

__all__ = ["Action", "Retry", "Send", "StreamState"]


@dataclass(frozen=True)
class Send:
    """Send ``frame`` on the socket the stream is attached to."""

    frame: dict[str, Any]


@dataclass(frozen=True)
class Retry:
    """Leave the socket; attach again after ``delay`` seconds (0: at once, on the next
    socket: the one this stream was on drains). ``until_ready``: a ``generate`` refused
    while no engine worker was ready, which may go again as soon as one is."""

    delay: float
    until_ready: bool = False


Action = Send | Retry


class StreamState:
    """What the client knows of one stream, and what it sends for it (see the module)."""

    def __init__(
        self,
        *,
        request: dict[str, Any] | None = None,
        stream_id: str | None = None,
        resume_token: str | None = None,
        after: int = 0,
        text: str = "",
        tool_calls: list[dict[str, Any]] | None = None,
        policy: RetryPolicy | None = None,
    ) -> None:
        if request is None and not (stream_id and resume_token):
            raise ValueError("a stream needs its generate frame, or a stream id and token")
        if after < 0:
            raise ValueError("after must be >= 0")
        self.request = request  # the generate frame; None for a stream resumed by id
        self.request_id: str | None = request.get("request_id") if request else None
        self.stream_id = stream_id
        self.resume_token = resume_token
        self.last_seq = after
        self.chunks: list[str] = [text] if text else []  # the texts delivered, in order
        self.tokens: list[Token] = []  # the token events received, in seq order
        self.logprobs: list[dict[str, Any]] = []  # with params.logprobs: one per token
        self.prompt_tokens: int | None = None
        self.finish_reason: FinishReason | str | None = None
        self.usage: Usage | None = None
        self.message: str | None = None  # the done frame's, with finish reason error
        # the calls so far (OpenAI's shape, arguments as far as they came), in index order;
        # the done frame's list once done. A resume starts from the calls held up to after.
        self.tool_calls: list[dict[str, Any]] = []
        self._streamed: dict[int, dict[str, Any]] = {}
        for index, call in enumerate(tool_calls or []):
            self._tool_delta(_as_delta(index, call))
        self.error: TokenRelayError | None = None
        self.policy = policy or RetryPolicy()
        self.retries = 0  # refused requests sent again, in all
        self._attempt = 0  # retries since the stream last started or resumed
        self.resumes = 0  # resumed frames received
        self.duplicates = 0  # token frames dropped as already held
        self.gaps = 0  # replays asked for because a seq was missing
        self.cancel_requested = False
        self.attached = False
        self._resyncing = False

    # --- state -------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Whether the stream ended (``done``) or failed (``error``)."""
        return self.finish_reason is not None or self.error is not None

    @property
    def started(self) -> bool:
        """Whether the stream is named (``started`` came, or it was resumed by id)."""
        return self.stream_id is not None

    @property
    def text(self) -> str:
        """Everything delivered so far (and the text a resume began with)."""
        return "".join(self.chunks)

    # --- inputs ------------------------------------------------------------------------

    def attach(self) -> list[dict[str, Any]]:
        """A socket is open for this stream: the frames to send on it, in order."""
        if self.finished:
            return []
        if self.stream_id and self.resume_token:
            self.attached = True
            self._resyncing = True
            frames = [resume_frame(self.stream_id, self.resume_token, self.last_seq)]
            if self.cancel_requested:
                frames.append(cancel_frame(self.stream_id, self.resume_token))
            return frames
        assert self.request is not None
        if self.cancel_requested:  # never started as far as we know, and nobody wants it
            self.finish_locally(FinishReason.CANCELLED)
            return []
        # A copy an earlier socket may have started is abandoned: the gateway ends it
        # after its detach timeout.
        self.attached = True
        return [self.request]

    def detach(self) -> None:
        """The socket this stream was attached to is gone (or no longer delivers it)."""
        self.attached = False
        self._resyncing = False

    def cancel(self) -> list[dict[str, Any]]:
        """Stop generating: the frames to send now (a ``cancel`` once the stream is named
        and attached; else it goes out with the next attach, or after ``started``)."""
        if self.finished:
            return []
        self.cancel_requested = True
        if self.stream_id:
            return [cancel_frame(self.stream_id, self.resume_token)] if self.attached else []
        if not self.attached:
            self.finish_locally(FinishReason.CANCELLED)
        return []

    def receive(self, f: ServerFrame, *, draining: bool = False) -> list[Action]:
        """A frame about this stream; ``draining``: its socket's gateway announced a drain."""
        if self.finished:
            return []
        if isinstance(f, Started):
            return self._started(f)
        if isinstance(f, ErrorFrame):
            return self._error(f, draining)
        if getattr(f, "stream_id", None) != self.stream_id:
            return []  # not ours (a frame of an abandoned copy)
        if isinstance(f, Token):
            return self._token(f)
        if isinstance(f, Done):
            return self._done(f)
        if isinstance(f, Resumed):
            self._resyncing = False
            self._attempt = 0
            self.resumes += 1
        return []  # cancelled (the ack of a cancel: the done follows), pong, notices

    def finish_locally(self, reason: FinishReason) -> None:
        """End the stream without a ``done`` from the server (a cancel that was never
        sent, or whose answer did not come in time)."""
        if not self.finished:
            self.finish_reason = reason

    def fail(self, error: TokenRelayError) -> None:
        """End the stream with ``error`` (the iteration raises it)."""
        if not self.finished:
            self.error = error
            if error.stream_id is None:
                error.stream_id = self.stream_id

    # --- frames ------------------------------------------------------------------------

    def _started(self, f: Started) -> list[Action]:
        if self.stream_id is not None or f.request_id != self.request_id:
            return []  # a second copy of our generate, started by an earlier socket
        self.stream_id, self.resume_token = f.stream_id, f.resume_token
        self.prompt_tokens = f.prompt_tokens
        self._attempt = 0
        if self.cancel_requested:
            return [Send(cancel_frame(f.stream_id, f.resume_token))]
        return []

    def _token(self, f: Token) -> list[Action]:
        if f.seq <= self.last_seq:
            self.duplicates += 1
            return []
        if f.seq != self.last_seq + 1:
            self.gaps += 1
            return self._resync()
        self.last_seq = f.seq
        self.chunks.append(f.text)
        self.tokens.append(f)
        if f.logprobs:
            self.logprobs.extend(f.logprobs)
        for delta in f.tool_calls:
            self._tool_delta(delta)
        return []

    def _tool_delta(self, d: ToolCallDelta) -> None:
        call = self._streamed.get(d.index)
        if call is None:  # its first entry (or one a resume after it began holds no head of)
            fn = {"name": d.name or "", "arguments": ""}
            call = self._streamed[d.index] = {"id": d.id or "", "type": "function", "function": fn}
            self.tool_calls = [self._streamed[i] for i in sorted(self._streamed)]
        call["function"]["arguments"] += d.arguments

    def _done(self, f: Done) -> list[Action]:
        if f.seq is not None and f.seq > self.last_seq + 1:
            self.gaps += 1
            return self._resync()
        if f.seq is not None:
            self.last_seq = max(self.last_seq, f.seq)
        self.usage = f.usage
        self.message = f.message
        self.tool_calls = list(f.tool_calls)  # authoritative: a call cut off is not in it
        self.finish_reason = f.finish_reason
        return []

    def _resync(self) -> list[Action]:
        if self._resyncing or not (self.stream_id and self.resume_token):
            return []
        self._resyncing = True
        return [Send(resume_frame(self.stream_id, self.resume_token, self.last_seq))]

    def _error(self, f: ErrorFrame, draining: bool) -> list[Action]:
        sid = f.stream_id or self.stream_id
        error = error_for(f.code, f.message, retry_after=f.retry_after, stream_id=sid,
                          request_id=f.request_id)  # fmt: skip
        if f.code not in RETRYABLE_CODES:
            self.fail(error)
            return []
        self.detach()  # "an error with a stream_id: this socket no longer delivers it"
        if f.code == ErrorCode.UNAVAILABLE and draining:
            return [Retry(0.0)]  # refused by a draining gateway: the next socket, uncounted
        self._attempt += 1
        delay = self.policy.retry_delay(self._attempt, f.code, f.retry_after)
        if delay is None:
            self.fail(error)
            return []
        self.retries += 1
        return [Retry(delay, f.code == ErrorCode.UNAVAILABLE and not self.started)]


def _as_delta(index: int, call: dict[str, Any]) -> ToolCallDelta:
    """A call held by a resuming caller (OpenAI's shape) as the first entry of its index."""
    fn = call.get("function") or {}
    return ToolCallDelta(index, str(fn.get("arguments") or ""), call.get("id"), fn.get("name"))
