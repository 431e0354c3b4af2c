"""A TCP proxy in front of a gateway that a test can cut, or point at another gateway.

The Python client's sockets go through it, so a test drops them the way a network does
(every connection reset at once, no close frame) without reaching into the client.
"""

from __future__ import annotations

import asyncio
import contextlib


class CutProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target`` (``host:port``, changeable)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.accepted = 0
        self.addr = ""  # host:port, once started
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        """Listen; the proxy's address."""
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.addr = f"127.0.0.1:{port}"
        return self.addr

    def cut(self) -> int:
        """Reset every open connection (both sides); how many there were."""
        pairs, self._pairs = list(self._pairs), set()
        for down, up in pairs:
            down.transport.abort()
            up.transport.abort()
        return len(pairs)

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        host, port = self.target.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self._pairs.add(pair)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self._pairs.discard(pair)
            for w in pair:
                w.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(OSError):
        writer.transport.abort()
