"""``tokenrelay.v1.Relay/Chat``: one bidirectional call carrying any number of streams.

Each call is a :class:`ChatCall`, a :class:`gateway.session.stream_session.StreamSession` (the
WebSocket protocol's generate / resume / cancel / tails, frames as dicts) whose frames are
turned into ``ServerFrame`` messages (gateway/grpc/convert.py) and written by one writer
task through a bounded queue (``send_queue`` frames, as a WebSocket's): a client that reads
slowly holds up its tails, never the gateway; the Redis log is the buffer.

How a call ends:

- the client half-closes: its streams finish, then the call ends ``OK``;
- the client cancels the call or the connection drops: a detach (the streams keep
  generating for ``--detach-timeout``; a ``Resume`` on a new call continues them);
- the gateway shuts down: a ``shutting_down`` notice, the drain, then ``UNAVAILABLE``;
- a client that keeps sending while rate limited: ``RESOURCE_EXHAUSTED``.

A call whose ``origin`` metadata (a browser's, through a gRPC-Web proxy) the WebSocket
would refuse ends at once with ``PERMISSION_DENIED``; a call without a valid API key
(``authorization: Bearer <key>`` metadata, when keys are configured) with
``UNAUTHENTICATED``; a call while more than
``--max-connections`` WebSockets and calls are open with ``RESOURCE_EXHAUSTED`` (one count:
a WebSocket is refused in the same way while calls fill it). The client's address (the
per-address limits, logs) is the peer's, or the one its ``x-forwarded-for`` metadata names
when the peer is a proxy of ``--forwarded-allow-ips`` (gateway/access/proxies.py: the rule
uvicorn applies to HTTP and WebSockets).
A ``traceparent`` in the call's metadata stands for the ``traceparent`` of every stream the
call starts (core/tracing.py; with ``--otlp-endpoint``: a parent, a link or nothing, by
``--client-traceparent``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from typing import TYPE_CHECKING, Any

import grpc

from tokenrelay.core.wire.vocabulary import ErrorCode
from tokenrelay.gateway.access.guard import Principal
from tokenrelay.gateway.errors import AuthError
from tokenrelay.gateway.grpc.convert import parse_client_frame, server_frame
from tokenrelay.gateway.session import protocol as p
from tokenrelay.gateway.session.stream_session import FrameRate, StreamSession

if TYPE_CHECKING:
    from tokenrelay.gateway.state import Gateway

log = logging.getLogger("tokenrelay.grpc")

CLOSE_WAIT_S = 2.0  # a closing call's queued frames get this long to leave


class _End:
    """Queued for the writer: end the call with this status after what is queued."""

    def __init__(self, code: grpc.StatusCode | None = None, details: str = "") -> None:
        self.code, self.details = code, details


def peer_address(peer: str) -> str:
    """The client's address from ``context.peer()`` (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or "?"
    if kind == "ipv6":
        host = rest.rpartition(":")[0]
        return host.strip("[]") or "?"
    return "?"


class ChatCall(StreamSession):
    """One ``Chat`` call and the streams it carries."""

    transport = "grpc"
    channel = "call"

    def __init__(
        self, gw: Gateway, pb2: Any, context: grpc.aio.ServicerContext, principal: Principal
    ) -> None:
        super().__init__(gw.session_parts, principal)
        self.gw = gw
        self.pb2 = pb2
        self.context = context
        self.queue: asyncio.Queue[Any] = asyncio.Queue(gw.settings.send_queue)
        self.rate = FrameRate()
        self._closing = False  # no new frames are taken (what is queued still goes)
        self._end: _End | None = None
        self.traceparent: str | None = None  # the call's metadata: its streams' trace parent

    # --- delivery --------------------------------------------------------------------

    async def send(self, frame: dict[str, Any]) -> None:
        """Queue a frame for the writer (waits while the queue is full)."""
        if frame.get("type") == "error":
            self.gw.metrics.count_error(frame.get("code", ErrorCode.INTERNAL), self.transport)
        if not self._closing:
            await self.queue.put(server_frame(self.pb2, frame))

    async def send_token(self, sid: str, seq: int, text: str, logprobs: str | None) -> None:
        if logprobs is not None:
            await self.send(p.token_frame(sid, seq, text, logprobs))
        elif not self._closing:
            token = self.pb2.Token(stream_id=sid, seq=seq, text=text)
            await self.queue.put(self.pb2.ServerFrame(token=token))

    def close(self, code: grpc.StatusCode, details: str) -> None:
        """End the call with ``code`` after what is queued (at once when the queue is full)."""
        if self._closing:
            return
        self._closing = True
        if self.queue.full():  # drop what a slow client has not read; it will resume
            self._drop_queued()
        self.queue.put_nowait(_End(code, details))

    def _drop_queued(self) -> None:
        while not self.queue.empty():
            self.queue.get_nowait()

    async def _write_loop(self) -> None:
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, _End):
                    self._end = item
                    return
                await self.context.write(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the call is gone
            log.debug("grpc write failed: %r", exc)
        finally:
            self._closing = True  # nobody sends any more: release whoever waits for room
            self._drop_queued()

    # --- the call ----------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the call until it ends (see the module's docstring for how)."""
        writer = asyncio.create_task(self._write_loop(), name="grpc-writer")
        reader: asyncio.Task[None] | None = None
        try:
            hello = await self.gw.hello()
            await self.send(hello)
            self.waiting_for_worker = not hello["worker_ready"]  # a notice will follow
            reader = asyncio.create_task(self._read_loop(), name="grpc-reader")
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if reader.done() and not writer.done():  # half-closed: let the streams finish
                while self.tails and not writer.done():
                    waiting = {*self.tails.values(), writer}
                    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if not self._closing:
                    self._closing = True
                    await self.queue.put(_End())
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(writer), CLOSE_WAIT_S)
        finally:
            if reader is not None:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            await self.detach_all()
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
        if self._end is not None and self._end.code is not None:
            self.context.set_code(self._end.code)
            self.context.set_details(self._end.details)

    async def _read_loop(self) -> None:
        while not self._closing:
            msg = await self.context.read()
            if msg is grpc.aio.EOF:
                return
            if not self.rate.allow():
                if self.rate.abusive:
                    self.close(grpc.StatusCode.RESOURCE_EXHAUSTED, "rate limit exceeded")
                    return
                await self.send(p.error_frame(ErrorCode.RATE_LIMITED, "too many frames; slow down"))
                continue
            await self.answer(functools.partial(self._parse, msg))

    def _parse(self, msg: Any) -> p.ClientFrame:
        frame = parse_client_frame(msg, self.gw.limits)
        if self.traceparent is not None and isinstance(frame, p.Generate):
            frame = dataclasses.replace(frame, traceparent=self.traceparent)
        return frame


class RelayService:
    """The ``tokenrelay.v1.Relay`` service of one gateway; tracks its open calls."""

    def __init__(self, gw: Gateway, pb2: Any) -> None:
        self.gw = gw
        self.pb2 = pb2
        self.calls: set[ChatCall] = gw.calls  # the gateway counts them with its WebSockets

    async def Chat(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        """One ``Chat`` call: authenticate, then serve it as protocol v1."""
        gw = self.gw
        pairs = [(k.lower(), v) for k, v in (context.invocation_metadata() or ())
                 if isinstance(v, str)]  # fmt: skip
        metadata = dict(pairs)
        forwarded = [v for k, v in pairs if k == "x-forwarded-for"]
        address = gw.proxies.client(peer_address(context.peer()), forwarded)
        origin = metadata.get("origin")  # a browser's call through a gRPC-Web proxy
        if not gw.guard.origins.allows(origin, metadata.get("host")):
            log.info("grpc origin refused", extra={"origin": (origin or "")[:200],
                                                   "client": address})  # fmt: skip
            gw.metrics.count_error(ErrorCode.FORBIDDEN, "grpc")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "origin not allowed")
        try:
            who = gw.guard.authenticate(metadata, {}, address)
        except AuthError as exc:
            gw.metrics.count_error(ErrorCode.UNAUTHORIZED, "grpc")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        if gw.shutting_down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "gateway shutting down")
        if gw.open_connections() >= gw.settings.max_connections:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many connections")
        call = ChatCall(gw, self.pb2, context, who)
        call.traceparent = metadata.get("traceparent")
        self.calls.add(call)
        try:
            await call.run()
        finally:
            self.calls.discard(call)

    async def notify(self, frame: dict[str, Any], timeout: float = 1.0) -> None:
        """Send ``frame`` to every open call (a call that does not read is skipped)."""

        async def one(call: ChatCall) -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(call.send(frame), timeout)

        await asyncio.gather(*(one(call) for call in list(self.calls)))

    async def close_calls(self, wait: float = CLOSE_WAIT_S) -> None:
        """End every call with ``UNAVAILABLE`` (shutdown) and wait up to ``wait`` s for them."""
        for call in list(self.calls):
            call.close(grpc.StatusCode.UNAVAILABLE, "gateway shutting down: resume elsewhere")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while self.calls and loop.time() < deadline:
            await asyncio.sleep(0.02)
