"""The asyncio client of the WebSocket protocol: :class:`AsyncClient`.

One client keeps one socket to a gateway (more while one drains) and carries any number
of streams over it; each :class:`AsyncStream` (client/stream.py) resumes by itself after
a dropped socket. The blocking twin is :class:`tokenrelay.client.Client`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tokenrelay.client.connection import ws_url
from tokenrelay.client.errors import NotFoundError, RequestTooLargeError
from tokenrelay.client.frames import encode, generate_frame
from tokenrelay.client.pool import Pool
from tokenrelay.client.retry import RetryPolicy
from tokenrelay.client.state import StreamState
from tokenrelay.client.stream import AsyncStream
from tokenrelay.core.wire.errors import NO_SUCH_STREAM
from tokenrelay.core.wire.keys import STREAM_ID_RE

__all__ = ["DEFAULT_URL", "AsyncClient"]

DEFAULT_URL = "http://127.0.0.1:8000"


class AsyncClient:
    """A client of a tokenrelay gateway over its WebSocket protocol (docs/client.md).

    ``url``: the gateway (``http(s)://`` or ``ws(s)://``, ``/v1/ws`` added); ``api_key``:
    sent as ``Authorization: Bearer`` when the gateway has keys. ``retry`` says how
    refusals (``overloaded``, ``unavailable``, ``rate_limited``) and lost sockets are
    retried; ``cancel_timeout`` how long :meth:`AsyncStream.cancel` waits for the end.
    Use it as ``async with``, or call :meth:`close`: closing detaches the streams (the
    gateway keeps generating them for its detach timeout, so they can be resumed).
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        api_key: str | None = None,
        *,
        retry: RetryPolicy | None = None,
        open_timeout: float = 10.0,
        cancel_timeout: float = 10.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.url = ws_url(url)
        self.retry = retry or RetryPolicy()
        self.cancel_timeout = cancel_timeout
        sent = dict(headers or {})
        if api_key:
            sent["Authorization"] = f"Bearer {api_key}"
        self._pool = Pool(self.url, sent, self.retry, open_timeout=open_timeout)
        self._streams: set[AsyncStream] = set()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def connects(self) -> int:
        """How many sockets this client opened (1 + its reconnects)."""
        return self._pool.connects

    @property
    def drains(self) -> int:
        """How many times a gateway announced a drain and the client moved on."""
        return self._pool.drains

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        model: str | None = None,
        request_id: str | None = None,
        traceparent: str | None = None,
        **params: Any,
    ) -> AsyncStream:
        """Start a chat completion and return its stream once the gateway started it.

        ``params`` are the protocol's sampling parameters (``max_tokens``,
        ``temperature``, ``stop``, ``tools``, ...: docs/protocol.md) as they are; a
        refused request raises its :class:`TokenRelayError` here (``BadRequestError``,
        or ``OverloadedError`` after the retries).
        """
        frame = generate_frame(messages=messages, params=params, request_id=request_id,
                               model=model, traceparent=traceparent)  # fmt: skip
        return await self._generate(frame)

    async def complete(
        self,
        prompt: str,
        *,
        model: str | None = None,
        request_id: str | None = None,
        traceparent: str | None = None,
        **params: Any,
    ) -> AsyncStream:
        """Like :meth:`chat` for raw ``prompt`` text (no chat template)."""
        frame = generate_frame(prompt=prompt, params=params, request_id=request_id,
                               model=model, traceparent=traceparent)  # fmt: skip
        return await self._generate(frame)

    async def resume(
        self,
        stream_id: str,
        resume_token: str,
        *,
        after: int = 0,
        text: str = "",
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> AsyncStream:
        """Re-attach to a stream started anywhere (another client, another process):
        its events with seq > ``after`` are delivered (``text`` and ``tool_calls``: what the
        caller already holds up to ``after``; the fragments that follow add to those calls).
        Raises ``NotFoundError`` (unknown or expired) or ``PermissionDeniedError`` (wrong
        token) here. A stream this client is streaming already is returned as it is (one
        socket tails a stream once)."""
        if not STREAM_ID_RE.fullmatch(stream_id):  # the gateway could not say which stream
            raise NotFoundError(NO_SUCH_STREAM, stream_id=stream_id[:64])
        for known in self._streams:
            if known.stream_id == stream_id and not known.finished:
                return known
        state = StreamState(stream_id=stream_id, resume_token=resume_token, after=after,
                            text=text, tool_calls=tool_calls, policy=self.retry)  # fmt: skip
        return await self._started(state, lambda: state.resumes > 0)

    async def close(self) -> None:
        """Stop every stream's task and close the sockets (a detach, not a cancel)."""
        streams, self._streams = list(self._streams), set()
        for stream in streams:
            await stream._stop()
        await self._pool.close()

    async def _generate(self, frame: dict[str, Any]) -> AsyncStream:
        conn = await self._pool.get()
        limit = conn.hello.max_frame_bytes
        if limit is not None and len(encode(frame).encode("utf-8")) > limit:
            raise RequestTooLargeError(
                f"the request is over the gateway's {limit}-byte frame limit"
            )
        state = StreamState(request=frame, policy=self.retry)
        return await self._started(state, lambda: state.started)

    async def _started(self, state: StreamState, ready: Callable[[], bool]) -> AsyncStream:
        """Start ``state``'s stream and wait until ``ready`` (its ``started``, its
        ``resumed``); its error raised. A caller that stops waiting gives the stream up."""
        stream = self._start(state)
        try:
            await stream._until(ready)
        except BaseException:
            stream._abandon()
            raise
        if state.error is not None:
            raise state.error
        return stream

    def _start(self, state: StreamState) -> AsyncStream:
        stream = AsyncStream(self._pool, state, cancel_timeout=self.cancel_timeout)
        self._streams = {s for s in self._streams if not s.finished}
        self._streams.add(stream)
        stream._start()
        return stream
