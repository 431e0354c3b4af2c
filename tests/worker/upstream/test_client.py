"""The relay's HTTP client against small asyncio servers: pooling, timeouts, failures.

The behaviour worker/upstream/call.py relies on: a response read to its end leaves its
connection for the next request; one closed early closes it (an upstream aborts what
nobody reads); a silent server is a :class:`ReadTimeout` per read, not per answer; a
connection cut mid-answer is a :class:`RemoteProtocolError` after the bytes that came.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.worker.upstream.fakeupstream import OK_HEAD, chunk, serving
from tokenrelay.worker.errors import ConnectError, ReadTimeout, RemoteProtocolError
from tokenrelay.worker.upstream.client import HttpClient


async def test_a_whole_answer_leaves_its_connection_for_the_next_request() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while True:
            await srv.read_request(r)
            w.write(OK_HEAD + chunk(b"one ") + chunk(b"two") + b"0\r\n\r\n")
            await w.drain()

    async with serving(handler) as (srv, client):
        for _ in range(3):
            resp, body = await client.request("POST", "/chat/completions", body=b"{}",
                                              headers={"Authorization": "Bearer k"})  # fmt: skip
            assert (resp.status_code, body) == (200, b"one two")
        assert srv.connections == 1
        first = srv.requests[0]
        assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"Authorization: Bearer k\r\n" in first and first.endswith(b"\r\n\r\n{}")


async def test_an_answer_closed_before_its_end_closes_the_connection() -> None:
    gone = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(OK_HEAD + chunk(b"data: 1\n\n"))
        await w.drain()
        await r.read()  # until the client closes its end
        gone.set()

    async with serving(handler) as (srv, client):
        async with client.stream("POST", "/x", body=b"{}") as resp:
            assert await resp.read() == b"data: 1\n\n"
        await asyncio.wait_for(gone.wait(), 5)  # the server saw the connection go


async def test_a_silent_server_is_a_read_timeout_and_a_slow_one_is_not() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(OK_HEAD)
        for _ in range(6):  # slow, but never silent for a whole timeout
            await asyncio.sleep(0.1)
            w.write(chunk(b"x"))
            await w.drain()
        await asyncio.sleep(10)  # then silent

    async with serving(handler, timeout=0.3) as (srv, client):
        got = b""
        with pytest.raises(ReadTimeout):
            async with client.stream("POST", "/x", body=b"{}") as resp:
                while True:
                    got += await resp.read()
        assert got == b"x" * 6


async def test_a_cut_mid_answer_fails_after_the_bytes_that_came() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(OK_HEAD + chunk(b"partial"))
        await w.drain()
        w.transport.abort()

    async with serving(handler) as (srv, client):
        resp = await client.send("POST", "/x", body=b"{}")
        assert await resp.read() == b"partial"
        with pytest.raises(RemoteProtocolError):
            await resp.read()
        resp.close()


async def test_a_kept_connection_the_server_closed_is_replaced() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        raw = await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        if n == 1:  # the first connection: read the next request, then close unanswered
            with contextlib.suppress(asyncio.IncompleteReadError):
                await srv.read_request(r)
        del raw

    async with serving(handler) as (srv, client):
        assert (await client.request("GET", "/models"))[1] == b"ok"
        assert (await client.request("GET", "/models"))[1] == b"ok"
        assert srv.connections == 2


async def test_a_refused_connection_is_a_connect_error() -> None:
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    client = HttpClient(f"http://127.0.0.1:{port}", timeout=1, connect_timeout=1,
                        max_connections=1)  # fmt: skip
    with pytest.raises(ConnectError):
        await client.request("GET", "/v1/models")


async def test_a_cancelled_request_frees_its_pool_slot() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        await asyncio.sleep(10)

    async with serving(handler) as (srv, client):
        for _ in range(6):  # more than max_connections (4)
            task = asyncio.create_task(client.request("GET", "/models"))
            await asyncio.sleep(0.05)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert client._slots is not None and not client._slots.locked()


def test_basic_auth_from_the_url_and_the_host_header() -> None:
    client = HttpClient("https://u:p%40ss@example.com/v1", timeout=1, connect_timeout=1,
                        max_connections=1)  # fmt: skip
    assert client.base_headers["Authorization"] == "Basic dTpwQHNz"
    assert (client.host_header, client.port, client.tls) == ("example.com", 443, True)
