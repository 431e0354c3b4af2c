"""A light WebSocket client for load generators: websockets' sans-I/O protocol, no tasks.

bench/gateway.py holds 1,000 client sockets in one process on the same two cores
as the server under test, so every microsecond its clients spend per message is
taken from the server. ``websockets.asyncio`` wakes one reader task per message
(a future, a queue, a task switch); this client instead hands each frame to a
callback, with :class:`websockets.client.ClientProtocol` doing the handshake, the
framing, masking, pongs and the closing handshake. The receipt time of a frame is
when its bytes reached the process: ``data_received`` only notes the time and
keeps the bytes, and the parsing runs in a callback scheduled after it, so that
the sockets that became readable together are all timestamped before any of them
is processed (processing them in ``data_received`` would add each one's parsing
to the receipt times of the sockets after it).

Until :meth:`LightClient.stream` is called, text frames queue up for
:meth:`LightClient.recv` (the handshake's ``hello`` and ``resumed``); after it,
each goes to the given callback with its receipt time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import cast

from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.uri import parse_uri

OnText = Callable[[str, float], None]  # (message, receipt time as Unix time)


class LightClient(asyncio.Protocol):
    """One client socket; see the module docstring."""

    def __init__(self, url: str) -> None:
        self.proto = ClientProtocol(parse_uri(url), max_size=None)
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._transport: asyncio.Transport | None = None
        self._inbox: asyncio.Queue[tuple[str, float]] = asyncio.Queue()
        self._on_text: OnText | None = None
        self._parts: list[bytes] = []  # a fragmented message's frames so far
        self._received: list[tuple[bytes, float]] = []  # (bytes, receipt time), not parsed yet

    @classmethod
    async def open(cls, url: str, timeout: float = 60.0) -> LightClient:
        """Connect and complete the opening handshake."""
        wsuri = parse_uri(url)
        loop = asyncio.get_running_loop()
        _, client = await asyncio.wait_for(
            loop.create_connection(lambda: cls(url), wsuri.host, wsuri.port), timeout
        )
        await asyncio.wait_for(client.opened, timeout)
        return client

    # --- asyncio.Protocol -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.proto.send_request(self.proto.connect())
        self._flush()

    def data_received(self, data: bytes) -> None:
        if not self._received:
            asyncio.get_running_loop().call_soon(self._parse)
        self._received.append((data, time.time()))

    def eof_received(self) -> bool | None:
        self._parse()  # what came before the end first
        self.proto.receive_eof()
        self._flush()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.opened.done():
            self.opened.set_exception(exc or ConnectionError("closed during the handshake"))
        if not self.closed.done():
            self.closed.set_result(None)

    # --- use ------------------------------------------------------------------------

    async def recv(self, timeout: float | None = None) -> tuple[str, float]:
        """The next text message and its receipt time (before :meth:`stream` only)."""
        return await asyncio.wait_for(self._inbox.get(), timeout)

    def stream(self, on_text: OnText) -> None:
        """From now on, hand every text message to ``on_text`` as it arrives."""
        while not self._inbox.empty():
            on_text(*self._inbox.get_nowait())
        self._on_text = on_text

    def send(self, text: str) -> None:
        self.proto.send_text(text.encode())
        self._flush()

    async def close(self, timeout: float = 5.0) -> None:
        """The closing handshake, then the socket; bounded by ``timeout``."""
        if self.proto.state is State.OPEN:
            self.proto.send_close(1000)
            self._flush()
        try:
            await asyncio.wait_for(asyncio.shield(self.closed), timeout)
        except TimeoutError:
            pass
        if self._transport is not None:
            self._transport.close()

    # --- internals ------------------------------------------------------------------

    def _parse(self) -> None:
        received, self._received = self._received, []
        for data, at in received:
            self.proto.receive_data(data)
            for event in self.proto.events_received():
                if isinstance(event, Frame):
                    self._frame(event, at)
                elif isinstance(event, Response) and not self.opened.done():
                    if self.proto.handshake_exc is not None:
                        self.opened.set_exception(self.proto.handshake_exc)
                    else:
                        self.opened.set_result(None)
        self._flush()  # pongs and the closing handshake's answer

    def _frame(self, frame: Frame, now: float) -> None:
        if frame.opcode is Opcode.TEXT or (frame.opcode is Opcode.CONT and self._parts):
            self._parts.append(frame.data)
            if not frame.fin:
                return
            text = b"".join(self._parts).decode()
            self._parts.clear()
            if self._on_text is not None:
                self._on_text(text, now)
            else:
                self._inbox.put_nowait((text, now))

    def _flush(self) -> None:
        transport = self._transport
        if transport is None:
            return
        for chunk in self.proto.data_to_send():
            if chunk:
                transport.write(chunk)
            elif transport.can_write_eof():
                transport.write_eof()
        if self.proto.close_expected() and self.proto.state is State.CLOSED:
            transport.close()
