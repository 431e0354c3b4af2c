"""Which web pages may talk to the gateway: the Origin check and CORS.

A request with no ``Origin`` (curl, SDKs, native apps) is allowed; so are
same-origin pages (the Origin's host:port is the request's ``Host``), pages
on localhost / 127.0.0.1 / [::1] (any port), and the origins given with
``--allow-origin`` (``*`` allows any). Anything else is refused: the
WebSocket handshake with 403 (gateway/ws/connection.py), the HTTP API under ``/v1/``
with 403 ``forbidden``. Allowed cross-origin HTTP calls get CORS headers,
and ``OPTIONS`` preflights are answered here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.openai_request import error_for_code

log = logging.getLogger("tokenrelay.cors")

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})
ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "Authorization, Content-Type, X-Request-Id, X-Resume-Token, Last-Event-ID"
EXPOSE_HEADERS = "X-Stream-Id, X-Resume-Token, X-Request-Id, Retry-After"
MAX_AGE = "600"


class OriginPolicy:
    """Decides whether a page's ``Origin`` may use the gateway."""

    def __init__(self, allowed: Iterable[str] = ()) -> None:
        items = {o.strip().rstrip("/").lower() for o in allowed if o.strip()}
        self.any = "*" in items
        self.allowed = frozenset(items - {"*"})

    def allows(self, origin: str | None, host: str | None) -> bool:
        """True for no Origin, same-origin, localhost and the allow list."""
        if origin is None:
            return True
        origin = origin.strip().rstrip("/").lower()
        if self.any or origin in self.allowed:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (file://, sandboxed frames) and the like
        if parts.hostname in LOCAL_HOSTS or f"[{parts.hostname}]" in LOCAL_HOSTS:
            return True
        return host is not None and parts.netloc == host.strip().lower()

    def allows_headers(self, headers: Mapping[str, str]) -> bool:
        return self.allows(headers.get("origin"), headers.get("host"))


class CORSMiddleware:
    """Origin check and CORS headers for the HTTP API (pure ASGI, streaming-safe)."""

    def __init__(self, app: ASGIApp, policy: OriginPolicy, paths: tuple[str, ...] = ("/v1/",)):
        self.app = app
        self.policy = policy
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope["path"]).startswith(self.paths):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        if not self.policy.allows(origin, headers.get("host")):
            log.info("origin refused", extra={"origin": origin[:200], "path": scope["path"]})
            await _forbidden(send, origin)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await _preflight(send, origin)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                raw = [(k, v) for k, v in message.get("headers", []) if not _is_cors(k)]
                raw += _cors_headers(origin)
                message = {**message, "headers": raw}
            await send(message)

        await self.app(scope, receive, send_with_cors)


def _is_cors(name: bytes) -> bool:
    return name.lower().startswith(b"access-control-")


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"access-control-allow-origin", origin.encode("latin-1", "replace")),
        (b"access-control-expose-headers", EXPOSE_HEADERS.encode()),
        (b"vary", b"Origin"),
    ]


async def _preflight(send: Send, origin: str) -> None:
    headers = [
        *_cors_headers(origin),
        (b"access-control-allow-methods", ALLOW_METHODS.encode()),
        (b"access-control-allow-headers", ALLOW_HEADERS.encode()),
        (b"access-control-max-age", MAX_AGE.encode()),
        (b"content-length", b"0"),
    ]
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


async def _forbidden(send: Send, origin: str) -> None:
    shown = origin[:100]
    err = error_for_code("forbidden", f"Origin {shown!r} is not allowed (see --allow-origin).")
    body = json.dumps(err.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"vary", b"Origin"),
    ]
    await send({"type": "http.response.start", "status": 403, "headers": headers})
    await send({"type": "http.response.body", "body": body})
