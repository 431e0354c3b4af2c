"""The blocking twin of :class:`AsyncClient`, for scripts and notebooks: :class:`Client`.

A :class:`Client` runs an :class:`AsyncClient` on an event loop in a thread of its own
(so it works where a loop already runs, as in Jupyter), and each call waits for its
result there. A :class:`Stream` is an :class:`AsyncStream` seen from the calling thread:
``for text in stream`` (or ``for event in stream.events()``) blocks for each delta; the
stream keeps resuming by itself.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Coroutine, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from tokenrelay.client.async_client import DEFAULT_URL, AsyncClient
from tokenrelay.client.errors import TokenRelayError
from tokenrelay.client.frames import Token, Usage
from tokenrelay.client.stream import AsyncStream
from tokenrelay.core.wire.vocabulary import FinishReason

__all__ = ["Client", "Stream"]

T = TypeVar("T")


class _LoopThread:
    """An event loop running in a daemon thread; :meth:`run` waits for a coroutine."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="tokenrelay-client")  # fmt: skip
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it (an interrupted wait cancels it)."""
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("a blocking tokenrelay Client was called from its own loop")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:  # e.g. Ctrl+C in a notebook: stop waiting there too
            future.cancel()
            raise

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


async def _next(it: AsyncGenerator[T, None]) -> T:
    return await it.__anext__()


class Stream:
    """A stream of the blocking :class:`Client`; the properties of :class:`AsyncStream`.

    ``for text in stream`` yields each token event's text from the first and ends after
    ``done``; it raises the stream's :class:`TokenRelayError` if it failed.
    """

    def __init__(self, runner: _LoopThread, stream: AsyncStream) -> None:
        self._runner = runner
        self._stream = stream

    def __iter__(self) -> Iterator[str]:
        return self._blocking(self._stream.__aiter__())

    def events(self) -> Iterator[Token]:
        """:meth:`AsyncStream.events`: each token event whole (text, ``tool_calls`` deltas,
        ``logprobs``), from the first."""
        return self._blocking(self._stream.events())

    def _blocking(self, it: AsyncGenerator[T, None]) -> Iterator[T]:
        while True:
            try:
                yield self._runner.run(_next(it))
            except StopAsyncIteration:
                return

    def wait(self) -> str:
        """Wait for the end; the whole text (raises the stream's error if it failed)."""
        return self._runner.run(self._stream.wait())

    def cancel(self) -> None:
        """Stop generating and wait for the end (``finish_reason`` ``cancelled``)."""
        self._runner.run(self._stream.cancel())

    @property
    def stream_id(self) -> str | None:
        """The stream's id."""
        return self._stream.stream_id

    @property
    def resume_token(self) -> str | None:
        """The secret that lets any client resume or cancel the stream."""
        return self._stream.resume_token

    @property
    def request_id(self) -> str | None:
        """The ``request_id`` of its ``generate``."""
        return self._stream.request_id

    @property
    def last_seq(self) -> int:
        """The last seq received."""
        return self._stream.last_seq

    @property
    def text(self) -> str:
        """The text received so far."""
        return self._stream.text

    @property
    def finished(self) -> bool:
        """Whether the stream ended or failed."""
        return self._stream.finished

    @property
    def finish_reason(self) -> FinishReason | str | None:
        """Why it ended, once done."""
        return self._stream.finish_reason

    @property
    def usage(self) -> Usage | None:
        """Token counts, once done."""
        return self._stream.usage

    @property
    def message(self) -> str | None:
        """The ``done`` frame's message."""
        return self._stream.message

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls so far while streaming; the ``done`` frame's once done."""
        return self._stream.tool_calls

    @property
    def logprobs(self) -> list[dict[str, Any]]:
        """With ``params.logprobs``: one entry per token received."""
        return self._stream.logprobs

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's length in tokens."""
        return self._stream.prompt_tokens

    @property
    def error(self) -> TokenRelayError | None:
        """Why the stream failed, if it did."""
        return self._stream.error

    @property
    def resumes(self) -> int:
        """How many times the stream was resumed."""
        return self._stream.resumes

    @property
    def retries(self) -> int:
        """How many times a refused ``generate`` or ``resume`` was sent again."""
        return self._stream.retries


class Client:
    """The blocking client: the arguments and methods of :class:`AsyncClient`, each call
    waiting for its result. Use it as ``with``, or call :meth:`close`."""

    def __init__(self, url: str = DEFAULT_URL, api_key: str | None = None, **options: Any) -> None:
        self._runner = _LoopThread()
        try:
            self._async = self._runner.run(_make(url, api_key, options))
        except BaseException:
            self._runner.stop()
            raise

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def aio(self) -> AsyncClient:
        """The :class:`AsyncClient` underneath (its loop runs in the client's thread)."""
        return self._async

    def chat(
        self, messages: Sequence[Mapping[str, Any]], *, model: str | None = None,
        request_id: str | None = None, traceparent: str | None = None, **params: Any,
    ) -> Stream:  # fmt: skip
        """:meth:`AsyncClient.chat`: start a chat completion, once started its stream."""
        coro = self._async.chat(messages, model=model, request_id=request_id,
                                traceparent=traceparent, **params)  # fmt: skip
        return Stream(self._runner, self._runner.run(coro))

    def complete(
        self, prompt: str, *, model: str | None = None, request_id: str | None = None,
        traceparent: str | None = None, **params: Any,
    ) -> Stream:  # fmt: skip
        """:meth:`AsyncClient.complete`: a completion of raw ``prompt`` text."""
        coro = self._async.complete(prompt, model=model, request_id=request_id,
                                    traceparent=traceparent, **params)  # fmt: skip
        return Stream(self._runner, self._runner.run(coro))

    def resume(
        self, stream_id: str, resume_token: str, *, after: int = 0, text: str = "",
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> Stream:  # fmt: skip
        """:meth:`AsyncClient.resume`: re-attach to a stream started anywhere."""
        coro = self._async.resume(stream_id, resume_token, after=after, text=text,
                                  tool_calls=tool_calls)  # fmt: skip
        return Stream(self._runner, self._runner.run(coro))

    def close(self) -> None:
        """Close the sockets (a detach) and stop the client's thread."""
        if self._runner.loop.is_closed():
            return
        try:
            self._runner.run(self._async.close())
        finally:
            self._runner.stop()


async def _make(url: str, api_key: str | None, options: dict[str, Any]) -> AsyncClient:
    return AsyncClient(url, api_key, **options)
