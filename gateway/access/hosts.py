"""Which ``Host`` headers the gateway answers: the DNS-rebinding guard.

A page on ``http://evil.example:8000`` whose name an attacker re-points at
127.0.0.1 is "same-origin" with a local gateway: its Origin and the Host header
agree. The Origin check alone cannot tell; the Host header can. A request is
answered when its Host is an IP address (rebinding needs a name: an address in
the URL is not the attacker's page), ``localhost``, the address the gateway was
told to bind (``--host``), or a name given with ``--allowed-hosts`` (``*`` for any,
``.example.com`` for a domain and its subdomains). Anything else gets 403
``forbidden`` (HTTP) or a refused handshake (WebSocket), and a log line.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenrelay.core.wire.vocabulary import ErrorCode
from tokenrelay.gateway.http.openai_request import error_for_code

log = logging.getLogger("tokenrelay.access")


def host_name(header: str) -> str:
    """The name or address part of a ``Host`` header, lower case, without port or brackets."""
    value = header.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        return value.partition(":")[0]
    return value  # a bare name, or a bare IPv6 address


class HostPolicy:
    """Decides whether a ``Host`` header names this gateway."""

    def __init__(self, allowed: Iterable[str] = (), bind_host: str | None = None) -> None:
        items = {host_name(h) for h in allowed if h.strip()}
        self.any = "*" in items
        self.suffixes = tuple(h for h in items if h.startswith("."))
        names = {h for h in items if not h.startswith(".")} - {"*"}
        names.add("localhost")
        if bind_host:
            names.add(host_name(bind_host))
        self.names = frozenset(names)

    def allows(self, host: str | None) -> bool:
        """True for no Host header (HTTP/1.0), an IP address, and the names above."""
        if host is None or self.any:
            return True
        name = host_name(host)
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            pass
        if name in self.names or name.endswith(".localhost"):
            return True
        return any(name.endswith(s) or name == s[1:] for s in self.suffixes)


class HostCheckMiddleware:
    """Refuse HTTP requests and WebSocket handshakes whose ``Host`` is not allowed."""

    def __init__(self, app: ASGIApp, policy: HostPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = Headers(scope=scope).get("host")
        if self.policy.allows(host):
            await self.app(scope, receive, send)
            return
        shown = (host or "")[:100]
        log.info("host refused", extra={"host": shown, "path": scope.get("path", "")})
        if scope["type"] == "websocket":  # closing before accept refuses the handshake (403)
            await send({"type": "websocket.close", "code": 1008})
            return
        err = error_for_code(
            ErrorCode.FORBIDDEN, f"Host {shown!r} is not allowed (see --allowed-hosts)."
        )
        body = json.dumps(err.body()).encode()
        await send({
            "type": "http.response.start",
            "status": 403,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": body})
