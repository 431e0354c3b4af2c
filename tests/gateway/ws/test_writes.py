"""How a connection writes frames: directly when it can, through the queue when it must.

:class:`gateway.ws.connection.Connection` writes a frame from the task that produced it
when nothing is queued and no write is in progress, and queues it otherwise.
These tests drive a connection over a scripted socket (no network: what is
checked is the ordering and the bookkeeping): every producer's frames arrive in
its order, exactly once, whatever the interleaving; frames queued before a
close go out before it; a failed write stops all sending and releases everyone.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace
from typing import Any

import pytest

from tokenrelay.gateway.ws.connection import Connection


class ScriptedSocket:
    """Records frames; a write may stall (a socket that is not writable) or fail."""

    def __init__(self, seed: int = 0, fail_at: int | None = None) -> None:
        self.frames: list[str] = []
        self.closed: tuple[int, str] | None = None
        self.writing = 0  # writes in progress (must never exceed 1)
        self.max_writing = 0
        self.fail_at = fail_at
        self._rng = random.Random(seed)

    async def _maybe_stall(self) -> None:
        roll = self._rng.random()
        if roll < 0.2:
            await asyncio.sleep(0)
        elif roll < 0.25:
            await asyncio.sleep(0.001)

    async def send_text(self, text: str) -> None:
        self.writing += 1
        self.max_writing = max(self.max_writing, self.writing)
        try:
            await self._maybe_stall()
            if self.fail_at is not None and len(self.frames) >= self.fail_at:
                raise OSError("connection reset")
            self.frames.append(text)
        finally:
            self.writing -= 1

    async def close(self, code: int, reason: str = "") -> None:
        self.closed = (code, reason)


def connection(sock: ScriptedSocket, queue: int = 8) -> Connection:
    gw: Any = SimpleNamespace(settings=SimpleNamespace(send_queue=queue), session_parts=None)
    return Connection(sock, gw)  # type: ignore[arg-type]


async def produce(conn: Connection, name: str, n: int, rng: random.Random) -> None:
    for i in range(n):
        await conn.send_encoded(f"{name}:{i}")
        if rng.random() < 0.3:
            await asyncio.sleep(0)


@pytest.mark.parametrize("seed", range(6))
async def test_every_producers_frames_arrive_once_and_in_order(seed: int) -> None:
    sock = ScriptedSocket(seed)
    conn = connection(sock)
    writer = asyncio.create_task(conn._write_loop())
    rng = random.Random(seed)
    names = [f"s{k}" for k in range(5)]
    await asyncio.gather(*(produce(conn, name, 300, rng) for name in names))
    conn.close(1000, "bye")
    await asyncio.wait_for(writer, 5)
    assert sock.max_writing == 1  # never two writes at once on one socket
    for name in names:
        mine = [f for f in sock.frames if f.startswith(name + ":")]
        assert mine == [f"{name}:{i}" for i in range(300)]
    assert len(sock.frames) == 5 * 300
    assert sock.closed == (1000, "bye")


async def test_frames_queued_before_a_close_go_out_first() -> None:
    sock = ScriptedSocket()
    conn = connection(sock, queue=64)
    stall = asyncio.Event()
    inner = sock.send_text

    async def first_write_stalls(text: str) -> None:
        if not sock.frames and not stall.is_set():
            await stall.wait()
        await inner(text)

    sock.send_text = first_write_stalls  # type: ignore[method-assign]
    writer = asyncio.create_task(conn._write_loop())
    direct = asyncio.create_task(conn.send_encoded("a"))  # written directly, stalls
    await asyncio.sleep(0)
    for text in ("b", "c", "d"):  # a write is in progress: these are queued
        await conn.send_encoded(text)
    assert conn.queue.qsize() == 3
    conn.close(4000, "done")
    await conn.send_encoded("after the close")  # not taken any more
    stall.set()
    await asyncio.wait_for(asyncio.gather(direct, writer), 5)
    assert sock.frames == ["a", "b", "c", "d"]
    assert sock.closed == (4000, "done")


async def test_a_failed_write_stops_sending_and_releases_everyone() -> None:
    sock = ScriptedSocket(seed=3, fail_at=10)
    conn = connection(sock, queue=4)
    writer = asyncio.create_task(conn._write_loop())
    rng = random.Random(1)
    # more than the queue holds: producers would wait on it forever if nobody released them
    await asyncio.wait_for(asyncio.gather(*(produce(conn, f"s{k}", 100, rng) for k in range(4))), 5)
    await asyncio.wait_for(writer, 5)  # the writer ends on its own
    assert len(sock.frames) == 10
    await conn.send_encoded("later")  # a no-op now
    assert len(sock.frames) == 10
    assert sock.closed is None


async def test_answers_to_client_frames_never_wait_for_a_stalled_socket() -> None:
    """The reader loop answers through the queue: a client that does not read can still
    have its ``cancel`` (or ``ping``) handled while its socket is not writable."""
    sock = ScriptedSocket()
    stalled = asyncio.Event()

    async def never_writable(text: str) -> None:
        stalled.set()
        await asyncio.Event().wait()  # the client stopped reading

    sock.send_text = never_writable  # type: ignore[method-assign]
    conn = connection(sock, queue=8)
    gw: Any = conn.gw
    gw.metrics = SimpleNamespace(count_error=lambda code, where: None)
    writer = asyncio.create_task(conn._write_loop())
    for _ in range(5):  # the reader's answers: queued at once, none written by the reader
        await asyncio.wait_for(conn.send({"type": "pong"}), 1)
    await asyncio.wait_for(stalled.wait(), 5)  # the writer is the one waiting
    assert conn.queue.qsize() == 4
    await asyncio.wait_for(conn.send_encoded("token"), 1)  # a tail's frame queues behind
    assert conn.queue.qsize() == 5
    writer.cancel()
    await asyncio.gather(writer, return_exceptions=True)


async def test_the_reader_never_writes_itself_even_when_idle() -> None:
    sock = ScriptedSocket()
    conn = connection(sock)
    entered = []
    inner = sock.send_text

    async def record(text: str) -> None:
        entered.append(asyncio.current_task())
        await inner(text)

    sock.send_text = record  # type: ignore[method-assign]
    writer = asyncio.create_task(conn._write_loop())
    await conn.send({"type": "pong"})
    conn.close(1000)
    await asyncio.wait_for(writer, 5)
    assert entered == [writer]
    assert sock.frames == ['{"type":"pong"}']
