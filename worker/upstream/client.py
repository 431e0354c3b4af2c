"""The relay's HTTP/1.1 client: pooled keep-alive connections to one upstream, on asyncio.

Why not httpx (which the relay used first): a streamed token is one read of a few
dozen bytes, and httpx's layers (httpcore, h11, anyio's streams, its text and line
decoders) cost most of a relay worker's CPU when it streams many tokens a second
(docs/benchmarks.md, "Relay latency"). Here each connection is an
:class:`asyncio.Protocol` that feeds the bytes to the sans-I/O parser of
worker/upstream/http1.py as they arrive; a reader waits on one future per read.

What it keeps of httpx's behaviour, which worker/upstream/call.py relies on:

- **timeouts**: connecting (TLS included) has ``connect_timeout``; waiting for a free
  connection, sending a request and *each read* have ``timeout`` (a read times out
  when nothing arrives for that long, so a stalled stream is noticed and a long
  answer never is cut): :class:`ConnectTimeout`, :class:`PoolTimeout`,
  :class:`WriteTimeout`, :class:`ReadTimeout`. One timer per waiting connection,
  re-armed at most once per ``timeout``, not one per read;
- **a response closed before its end closes its connection** (a cancelled call
  ends the upstream's generation: vLLM, TGI and llama.cpp abort on disconnect); one
  read to its end goes back to the pool when the server keeps it alive;
- **a bounded pool** (``max_connections``), LIFO, connections the server closed
  dropped; a request that finds a reused connection closed before any byte of an
  answer is sent again once on a new one (the server closed it while idle);
- **TLS** for ``https`` (the system's CA certificates, and certifi's where
  installed, as httpx used; ALPN ``http/1.1``), **basic auth** from a URL's
  userinfo. No proxies (the relay never read ``HTTP_PROXY``), no redirects, no
  compression (it asks for ``identity``).

Every failure is a :class:`TransportError`, named as httpx named them.

Long: a connection's protocol, the response reading it and the pool that lends and
takes it back share one connection's state (its parser, its waiter, its timer);
apart, each would reach into the others' private fields.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
from collections.abc import AsyncIterator
from typing import Any, cast
from urllib.parse import unquote, urlsplit

from tokenrelay.core.runtime import version
from tokenrelay.worker.errors import (
    ConnectError,
    ConnectTimeout,
    MalformedHttp,
    PoolTimeout,
    ReadTimeout,
    RemoteProtocolError,
    TransportError,
    WriteTimeout,
)
from tokenrelay.worker.upstream.http1 import Head, ResponseParser, request_bytes

PAUSE_AT = 1 << 20  # bytes of body buffered unread: stop reading the socket meanwhile


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection; the parser of the response it is reading."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser: ResponseParser | None = None
        self.closed = False
        self.reused = False  # it carried an answer before this one
        self.received = False  # bytes of the current answer have arrived
        self.body: list[bytes] = []  # body bytes not yet read
        self.error: TransportError | None = None
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._wait_since = 0.0
        self._timeout = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._writable = True
        self._drained: asyncio.Future[None] | None = None

    # --- asyncio.Protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is no subclass)

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None:  # an idle connection has nothing to say
            self.close()
            return
        self.received = True
        try:
            body = parser.feed(data)
        except MalformedHttp as exc:
            self._fail(RemoteProtocolError(str(exc)))
            self.close()
            return
        if body:
            self.body.append(body)
            self._buffered += len(body)
            if self._buffered >= PAUSE_AT and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        if self.parser is not None:
            try:
                self.parser.eof()
            except MalformedHttp:
                said = "server disconnected without a complete answer"
                self._fail(RemoteProtocolError(said))
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        parser = self.parser
        if parser is not None and not parser.done:
            if exc is None:
                said = "server disconnected without a complete answer"
            else:
                said = f"{type(exc).__name__}: {exc}".rstrip(": ")
            self._fail(RemoteProtocolError(said))
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        self._writable = False

    def resume_writing(self) -> None:
        self._writable = True
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # --- the reader's side ----------------------------------------------------------

    def begin(self, method: str) -> None:
        """A new request goes out on this connection."""
        self.parser = ResponseParser(method=method)
        self.received = False
        self.body, self._buffered, self.error = [], 0, None

    async def send(self, data: bytes, timeout: float) -> None:
        assert self.transport is not None
        self.transport.write(data)
        if self._writable or self.closed:
            return
        self._drained = self.loop.create_future()
        try:
            await asyncio.wait_for(self._drained, timeout)
        except TimeoutError:
            raise WriteTimeout(f"the request was not sent within {timeout:g} s") from None
        finally:
            self._drained = None

    def take_body(self) -> bytes:
        body, self.body = self.body, []
        self._buffered = 0
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return body[0] if len(body) == 1 else b"".join(body)

    async def wait(self, timeout: float) -> None:
        """Until something arrives, the connection closes, or ``timeout`` passes in silence
        (:class:`ReadTimeout`)."""
        if self.closed:
            return
        waiter = self._waiter = self.loop.create_future()
        self._wait_since = self.loop.time()
        self._timeout = timeout
        if self._timer is None:
            self._timer = self.loop.call_at(self._wait_since + timeout, self._on_timer)
        try:
            await waiter
        finally:
            self._waiter = None

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # a later wait arms the timer again
        deadline = self._wait_since + self._timeout
        if self.loop.time() >= deadline:
            waiter.set_exception(ReadTimeout(f"nothing received for {self._timeout:g} s"))
        else:
            self._timer = self.loop.call_at(deadline, self._on_timer)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: TransportError) -> None:
        if self.error is None:
            self.error = error

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        self._cancel_timer()
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    def idle(self) -> None:
        """The answer was read to its end: the connection waits for the next request."""
        self._cancel_timer()
        self.parser = None
        self.reused = True


class Response:
    """A response whose head is in; :meth:`read` its body, :meth:`close` it when done."""

    def __init__(self, client: HttpClient, conn: _Connection, head: Head, timeout: float) -> None:
        self._client = client
        self._conn = conn
        self.head = head
        self.status_code = head.status
        self._timeout = timeout
        self._closed = False

    @property
    def headers(self) -> dict[str, str]:
        """The headers, by lower-case name."""
        return self.head.headers

    async def read(self) -> bytes:
        """The body bytes that arrived since the last read (waiting for some); ``b""`` at
        the end. Bytes that arrived before a failure are read before it is raised."""
        conn = self._conn
        while True:
            if conn.body:
                return conn.take_body()
            if conn.error is not None:
                raise conn.error
            parser = conn.parser
            assert parser is not None
            if parser.done:
                self.close()
                return b""
            if conn.closed:
                raise RemoteProtocolError("server disconnected without a complete answer")
            await conn.wait(self._timeout)

    async def read_some(self, limit: int) -> bytes:
        """Up to ``limit`` bytes of the body (the rest left unread: the connection closes)."""
        out = b""
        while len(out) < limit and (data := await self.read()):
            out += data
        return out[:limit]

    def close(self) -> None:
        """Done with the answer: its connection goes back to the pool when it was read to
        its end and may carry another request, else it closes."""
        if self._closed:
            return
        self._closed = True
        self._client._release(self._conn)


class HttpClient:
    """Requests to one server (``base_url``'s scheme, host and port) over a bounded pool."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float,
        connect_timeout: float,
        max_connections: int,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        default = 443 if self.tls else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if self.port == default else f"{host}:{self.port}"
        self.path = parts.path.rstrip("/")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        self.base_headers = {"User-Agent": f"tokenrelay/{version()}", "Accept-Encoding": "identity"}
        if parts.username is not None or parts.password is not None:
            user = unquote(parts.username or "")
            secret = unquote(parts.password or "")
            token = base64.b64encode(f"{user}:{secret}".encode()).decode("ascii")
            self.base_headers["Authorization"] = f"Basic {token}"
        self._idle: list[_Connection] = []
        self._slots: asyncio.Semaphore | None = None
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    # --- requests --------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        timeout: float | None = None,
    ) -> AsyncIterator[Response]:
        """The response to ``method`` ``base path + path``, closed on leaving the block."""
        resp = await self.send(method, path, headers=headers, body=body, timeout=timeout)
        try:
            yield resp
        finally:
            resp.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        timeout: float | None = None,
        limit: int = 4 << 20,
    ) -> tuple[Response, bytes]:
        """A whole exchange: the response and its body (at most ``limit`` bytes read)."""
        async with self.stream(method, path, headers=headers, body=body, timeout=timeout) as r:
            return r, await r.read_some(limit)

    async def send(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        timeout: float | None = None,
    ) -> Response:
        """Send a request; the response once its head is in (:meth:`Response.close` it)."""
        if self._closed:
            raise TransportError("the client is closed")
        wait = self.timeout if timeout is None else timeout
        data = request_bytes(method, self.path + path, self.host_header,
                             {**self.base_headers, **(headers or {})}, body)  # fmt: skip
        await self._acquire(wait)
        try:
            for attempt in (0, 1):
                conn = await self._connection()
                try:
                    head = await self._exchange(conn, method, data, wait)
                except RemoteProtocolError:
                    conn.close()
                    if attempt == 0 and conn.reused and not conn.received:
                        continue  # closed by the server while idle: once more, on a new one
                    raise
                except BaseException:
                    conn.close()
                    raise
                return Response(self, conn, head, wait)
            raise AssertionError("unreachable")
        except BaseException:
            self._release_slot()
            raise

    async def _exchange(self, conn: _Connection, method: str, data: bytes, wait: float) -> Head:
        conn.begin(method)
        await conn.send(data, wait)
        parser = conn.parser
        assert parser is not None
        while parser.head is None:
            if conn.error is not None:
                raise conn.error
            if conn.closed:
                raise RemoteProtocolError("server disconnected without sending a response")
            await conn.wait(wait)
        return parser.head

    # --- the pool ----------------------------------------------------------------------

    async def _acquire(self, wait: float) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_connections)
        if not self._slots.locked():
            await self._slots.acquire()  # at once
            return
        try:
            await asyncio.wait_for(self._slots.acquire(), wait)
        except TimeoutError:
            raise PoolTimeout(f"no connection free within {wait:g} s") from None

    def _release_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        return await self._connect()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        kwargs: dict[str, Any] = {}
        if self.tls:
            kwargs = {"ssl": self._ssl_context(), "server_hostname": self.host}
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(loop), self.host, self.port, **kwargs),
                self.connect_timeout,
            )
        except TimeoutError:
            said = f"no connection within {self.connect_timeout:g} s"
            raise ConnectTimeout(said) from None
        except (OSError, ssl.SSLError) as exc:
            raise ConnectError(str(exc) or type(exc).__name__) from None
        return conn

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            ctx = ssl.create_default_context()
            with contextlib.suppress(ImportError, OSError):
                import certifi

                ctx.load_verify_locations(certifi.where())
            ctx.set_alpn_protocols(["http/1.1"])
            self._ssl = ctx
        return self._ssl

    def _release(self, conn: _Connection) -> None:
        parser = conn.parser
        if parser is not None and parser.reusable and not conn.closed and not self._closed:
            conn.idle()
            self._idle.append(conn)
        else:
            conn.close()
        self._release_slot()

    async def aclose(self) -> None:
        """Close the idle connections; the client takes no more requests."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        await asyncio.sleep(0)
