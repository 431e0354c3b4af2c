"""A stream of the asyncio client: text deltas, the outcome, cancel; it resumes by itself.

An :class:`AsyncStream` runs its :class:`StreamState` (client/state.py) in a task of its
own: the task attaches the stream to the client's primary socket (client/pool.py), feeds
it the frames its :class:`Connection` routes to it, sends what the state asks for, and
when the socket is lost or a retryable refusal comes, attaches it again (a ``resume``
after the last seq, or the ``generate`` again when no ``started`` came). It keeps going
whether or not anyone iterates: ``text``, ``last_seq`` and the rest are always current,
and every iteration yields every delta from the first: ``async for text in stream`` the
texts, ``async for event in stream.events()`` the token events whole (the text, a call's
``tool_calls`` deltas, ``logprobs``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, TypeVar

from tokenrelay.client.connection import Connection
from tokenrelay.client.errors import InternalServerError, TokenRelayError
from tokenrelay.client.frames import ServerFrame, Token, Usage
from tokenrelay.client.pool import Pool
from tokenrelay.client.state import Retry, Send, StreamState
from tokenrelay.core.wire.vocabulary import FinishReason

__all__ = ["AsyncStream"]

T = TypeVar("T")


class _Attachment:
    """The stream on one socket, once: frames of an attachment the stream has left (a
    socket it retried away from) are told apart from the current one's."""

    def __init__(self, stream: AsyncStream, conn: Connection) -> None:
        self.stream = stream
        self.conn = conn

    def deliver(self, frame: ServerFrame | None) -> None:
        self.stream._inbox.put_nowait((self, frame))


class AsyncStream:
    """One completion as it streams (see the module). ``async for text in stream`` yields
    each token event's text, from the first, and ends after ``done`` whatever its finish
    reason; it raises the stream's :class:`TokenRelayError` if it failed."""

    def __init__(self, pool: Pool, state: StreamState, *, cancel_timeout: float = 10.0) -> None:
        self._pool = pool
        self._state = state
        self._cancel_timeout = cancel_timeout
        self._inbox: asyncio.Queue[tuple[_Attachment, ServerFrame | None]] = asyncio.Queue()
        self._att: _Attachment | None = None
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # --- what the stream holds ----------------------------------------------------------

    @property
    def stream_id(self) -> str | None:
        """The stream's id (set once the gateway started it)."""
        return self._state.stream_id

    @property
    def resume_token(self) -> str | None:
        """The secret that lets any client resume or cancel the stream."""
        return self._state.resume_token

    @property
    def request_id(self) -> str | None:
        """The ``request_id`` of its ``generate`` (None for a stream resumed by id)."""
        return self._state.request_id

    @property
    def last_seq(self) -> int:
        """The last seq received, ahead of an iteration that has not caught up yet: resume
        with ``after=last_seq`` and ``text`` read at the same moment."""
        return self._state.last_seq

    @property
    def text(self) -> str:
        """The text received so far (all of it once finished)."""
        return self._state.text

    @property
    def finished(self) -> bool:
        """Whether the stream ended or failed."""
        return self._state.finished

    @property
    def finish_reason(self) -> FinishReason | str | None:
        """``stop``, ``length``, ``tool_calls``, ``cancelled``, ``expired`` or ``error``
        once done (``message`` says why for ``error``); None until then."""
        return self._state.finish_reason

    @property
    def usage(self) -> Usage | None:
        """Token counts, once done."""
        return self._state.usage

    @property
    def message(self) -> str | None:
        """The ``done`` frame's message (why a stream ended with ``error``)."""
        return self._state.message

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """With ``params.tools``, the calls (OpenAI's shape: ``id``, ``type``, ``function``
        ``{name, arguments}``): while streaming, each call begun so far with its arguments
        as far as they came; once done, the ``done`` frame's list (a call cut off is not
        in it)."""
        return self._state.tool_calls

    @property
    def logprobs(self) -> list[dict[str, Any]]:
        """With ``params.logprobs``: one entry per token received, OpenAI's chat shape."""
        return self._state.logprobs

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's length in tokens (from ``started``)."""
        return self._state.prompt_tokens

    @property
    def error(self) -> TokenRelayError | None:
        """Why the stream failed, if it did."""
        return self._state.error

    @property
    def resumes(self) -> int:
        """How many times the stream was resumed (each ``resumed`` frame)."""
        return self._state.resumes

    @property
    def duplicates(self) -> int:
        """Token events dropped because their seq was already held (there should be none)."""
        return self._state.duplicates

    @property
    def gaps(self) -> int:
        """Replays asked for because a seq was missing (there should be none)."""
        return self._state.gaps

    @property
    def retries(self) -> int:
        """How many times a refused ``generate`` or ``resume`` was sent again."""
        return self._state.retries

    # --- using it ------------------------------------------------------------------------

    def __aiter__(self) -> AsyncGenerator[str, None]:
        return self._follow(lambda: self._state.chunks)

    def events(self) -> AsyncGenerator[Token, None]:
        """Each token event received, from the first, as :class:`Token`: its ``seq``,
        ``text`` and ``tool_calls`` (:class:`ToolCallDelta`: a call's ``index``, with
        ``id`` and ``name`` in its first entry, and an ``arguments`` fragment), ``logprobs``.
        Ends after ``done`` and raises as iterating the stream does."""
        return self._follow(lambda: self._state.tokens)

    async def _follow(self, items: Callable[[], Sequence[T]]) -> AsyncGenerator[T, None]:
        i = 0
        while True:
            held = items()
            while i < len(held):
                yield held[i]
                i += 1
            if self._state.finished:
                if self._state.error is not None:
                    raise self._state.error
                return
            await self._changed.wait()

    async def wait(self) -> str:
        """Wait for the end; the whole text (raises the stream's error if it failed)."""
        await self._until(lambda: False)
        if self._state.error is not None:
            raise self._state.error
        return self._state.text

    async def cancel(self) -> None:
        """Stop generating (the gateway frees the sequence at its next step) and wait for
        the stream's end: ``finish_reason`` is then ``cancelled``, or how it ended first.
        Not the same as leaving: a stream nobody reads keeps generating."""
        att = self._att
        for frame in self._state.cancel():
            if att is not None:
                await att.conn.send(frame)
        if self._state.finished:  # it had ended, or never went out: nothing to wait for
            await self._stop()
            return
        try:
            async with asyncio.timeout(self._cancel_timeout):
                await self._until(lambda: False)
        except TimeoutError:  # no answer in time: end it here
            self._state.finish_locally(FinishReason.CANCELLED)
            await self._stop()

    # --- the task ------------------------------------------------------------------------

    def _start(self) -> None:
        self._task = asyncio.create_task(self._drive(), name="tokenrelay-client-stream")

    async def _until(self, done: Callable[[], bool]) -> None:
        while not done() and not self._state.finished:
            await self._changed.wait()

    def _abandon(self) -> None:
        """Nobody waits for the stream any more (its ``chat`` or ``resume`` was cancelled):
        a ``generate`` not started yet is cancelled as soon as it starts (or ends here if it
        never went out); a resume just stops."""
        if self._state.request is not None and not self._state.started:
            self._state.cancel()
            if not self._state.finished:
                return  # the task sends the cancel after ``started``, then ends
        if self._task is not None:
            self._task.cancel()
        self._leave()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._leave()
        self._notify()

    async def _drive(self) -> None:
        try:
            await self._attach()
            while not self._state.finished:
                att, frame = await self._inbox.get()
                if att is not self._att:
                    continue  # from a socket this stream has left
                if frame is None:  # the socket is gone: attach again
                    self._leave()
                    await self._attach()
                    continue
                actions = self._state.receive(frame, draining=att.conn.draining)
                self._notify()
                for action in actions:
                    if isinstance(action, Send):
                        await att.conn.send(action.frame)  # a lost socket comes as None
                    elif isinstance(action, Retry):
                        self._leave()
                        if action.until_ready:  # a worker that becomes ready cuts it short
                            await self._pool.wait_ready(action.delay)
                        else:
                            await asyncio.sleep(action.delay)
                        await self._attach()
        except TokenRelayError as exc:
            self._state.fail(exc)
        except Exception as exc:  # a bug: fail the stream rather than hang its readers
            self._state.fail(InternalServerError(f"the client failed: {exc!r}"))
        finally:
            self._leave()
            self._notify()

    async def _attach(self) -> None:
        if self._state.finished:
            return
        conn = await self._pool.get()
        frames = self._state.attach()
        if not frames:
            self._notify()
            return
        att = self._att = _Attachment(self, conn)
        conn.register(att, request_id=self._state.request_id, stream_id=self._state.stream_id)
        for frame in frames:
            if not await conn.send(frame):
                break  # its sinks are told: the loop attaches again

    def _leave(self) -> None:
        att, self._att = self._att, None
        if att is not None:
            att.conn.unregister(att)
            self._state.detach()
