"""A TCP proxy that breaks the upstream's answers on purpose, in a thread of its own.

It sits between a relay worker and its upstream (the relay's ``--upstream`` names
the proxy's port) and serves for a whole session, whatever event loop each test
runs: its own loop runs in a daemon thread. :meth:`FaultProxy.set_mode` chooses
what the next connections get (and severs the open ones, so a relay's pooled
keep-alive connections start afresh):

- ``pass``: bytes both ways, untouched;
- ``refuse``: the port stops listening (a connect is refused: ECONNREFUSED);
- ``cut``: the upstream's answer is forwarded up to ``after`` bytes, then both
  sides are reset (RST): a connection cut mid-stream;
- ``stall``: forwarded up to ``after`` bytes, then nothing more, the connection
  left open: an upstream that hangs;
- ``status``: the proxy answers every request itself with HTTP ``status`` (and
  ``Retry-After: 1``) and closes: an upstream that is overloaded (503, 429).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from typing import Any

PASS, REFUSE, CUT, STALL, STATUS = "pass", "refuse", "cut", "stall", "status"


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``127.0.0.1:<target>``, breaking it on demand."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.mode, self.after = PASS, 0
        with socket.socket() as s:  # a port of our own, kept across refuse/pass
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.connections = 0  # accepted so far
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._call(self._listen())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def set_mode(self, mode: str, after: int = 0) -> None:
        self._call(self._set(mode, after))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._call(self._set(REFUSE, 0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _set(self, mode: str, after: int) -> None:
        self.mode, self.after = mode, after
        for w in list(self._open):
            w.transport.abort()
        if mode == REFUSE and self._server is not None:
            self._server.close()
            self._server = None
        elif mode != REFUSE and self._server is None:
            await self._listen()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        mode, after = self.mode, self.after
        if mode == STATUS:
            await _answer_status(reader, writer, after)
            return
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        self._open.update((writer, up_w))
        try:
            await asyncio.gather(_pipe(reader, up_w), self._answer(up_r, writer, mode, after))
        finally:
            for w in (writer, up_w):
                self._open.discard(w)
                w.transport.abort()

    async def _answer(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, mode: str, after: int
    ) -> None:
        """The upstream's answer to the client, broken after ``after`` bytes per ``mode``."""
        sent = 0
        try:
            while data := await src.read(65536):
                if mode in (CUT, STALL) and sent + len(data) >= after:
                    dst.write(data[: max(0, after - sent)])
                    await dst.drain()
                    if mode == CUT:
                        dst.transport.abort()
                        return
                    while await src.read(65536):  # stall: swallow the rest, send nothing
                        pass
                    return
                dst.write(data)
                await dst.drain()
                sent += len(data)
        except (ConnectionError, OSError):
            pass
        finally:
            if mode != STALL:
                dst.transport.abort()


async def _answer_status(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         status: int) -> None:  # fmt: skip
    body = b'{"error": {"message": "injected by the fault proxy"}}'
    head = (
        f"HTTP/1.1 {status} Injected\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    try:
        request = await reader.readuntil(b"\r\n\r\n")
        for line in request.decode("latin-1").split("\r\n"):
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                await reader.readexactly(int(value))  # read it all: closing then sends no RST
        writer.write(head.encode() + body)
        await writer.drain()
    except (ConnectionError, OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        dst.transport.abort()
