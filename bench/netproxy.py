"""A small TCP proxy whose connections can be severed: a network cut between client and gateway.

    proxy = await TcpProxy.start("127.0.0.1", 8000)   # listens on proxy.addr
    ...
    proxy.sever()    # abort every open connection, both sides, no close handshake

New connections keep working after :meth:`TcpProxy.sever` (the "network"
comes back); :meth:`TcpProxy.block` refuses them until :meth:`TcpProxy.unblock`.
Used by bench/faults.py and bench/soak.py.
"""

from __future__ import annotations

import asyncio
import contextlib


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``host:port``."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.server: asyncio.Server | None = None
        self.pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self.blocked = False
        self.severed = 0

    @classmethod
    async def start(cls, host: str, port: int) -> TcpProxy:
        proxy = cls(host, port)
        proxy.server = await asyncio.start_server(proxy._serve, "127.0.0.1", 0)
        return proxy

    @property
    def addr(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.blocked:
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_w)
        self.pairs.add(pair)
        try:
            await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))
        finally:
            self.pairs.discard(pair)
            for w in pair:
                w.transport.abort()

    def sever(self) -> int:
        """Abort every open connection (RST both ways); returns how many."""
        n = 0
        for down, up in list(self.pairs):
            down.transport.abort()
            up.transport.abort()
            n += 1
        self.severed += n
        return n

    def block(self) -> None:
        """Refuse new connections (and sever the open ones)."""
        self.blocked = True
        self.sever()

    def unblock(self) -> None:
        self.blocked = False

    async def close(self) -> None:
        self.sever()
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    except (ConnectionError, OSError, asyncio.CancelledError):
        pass
    finally:
        dst.transport.abort()
