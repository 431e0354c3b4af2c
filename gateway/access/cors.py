"""Which web pages may talk to the gateway: the Origin check and CORS.

A request with no ``Origin`` (curl, SDKs, native apps) is allowed; so are
same-origin pages (the Origin's host:port is the request's ``Host``), pages
on localhost / 127.0.0.1 / [::1] (any port), and the origins given with
``--allow-origin`` (``*`` allows any). Anything else is refused: the
WebSocket handshake with 403 (gateway/ws/connection.py), the HTTP API under ``/v1/``
with 403 ``forbidden``. Allowed cross-origin HTTP calls get CORS headers,
and ``OPTIONS`` preflights are answered here.

A preflight is answered with the fixed :data:`ALLOW_HEADERS` plus every header
it asks for (``Access-Control-Request-Headers``: SDKs send their own, such as
the OpenAI SDK's ``x-stainless-*``), within bounds: at most
:data:`MAX_REQUEST_HEADERS` names of at most :data:`MAX_HEADER_NAME` characters,
each an HTTP token, :data:`MAX_REQUEST_HEADERS_CHARS` characters in all. A
preflight outside them is refused whole with 400 ``bad_request`` (no CORS
headers, so the browser blocks the request) rather than answered with the names
it could accept: the browser would block the request for the missing names
anyway, and a 400 that says why is easier to find than a 204 without them.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenrelay.core.wire.vocabulary import ErrorCode
from tokenrelay.gateway.errors import BadPreflight
from tokenrelay.gateway.http.openai_request import error_for_code

log = logging.getLogger("tokenrelay.cors")

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})
ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "Authorization, Content-Type, X-Request-Id, X-Resume-Token, Last-Event-ID"
EXPOSE_HEADERS = "X-Stream-Id, X-Resume-Token, X-Request-Id, Retry-After"
MAX_AGE = "600"
MAX_REQUEST_HEADERS = 64  # names in one preflight's Access-Control-Request-Headers
MAX_HEADER_NAME = 64  # characters in one of them
MAX_REQUEST_HEADERS_CHARS = 4096  # the whole (raw) Access-Control-Request-Headers
PREFLIGHT_VARY = "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token: a valid header name
_HTTP_WHITESPACE = " \t"


def allow_headers(requested: str | None) -> str:
    """The ``Access-Control-Allow-Headers`` answer to a preflight that asks for ``requested``.

    :data:`ALLOW_HEADERS`, then each requested name not already in it (lower-cased,
    once), in the order asked. Empty list items are skipped, as the Fetch standard
    parses the header. Raises :class:`BadPreflight` for a name that is not an HTTP
    token and for a list over the bounds.
    """
    if requested is None:
        return ALLOW_HEADERS
    if len(requested) > MAX_REQUEST_HEADERS_CHARS:
        raise BadPreflight(
            f"Access-Control-Request-Headers is over {MAX_REQUEST_HEADERS_CHARS} characters"
        )
    known = {name.strip().lower() for name in ALLOW_HEADERS.split(",")}
    extra: list[str] = []
    count = 0
    for item in requested.split(","):
        name = item.strip(_HTTP_WHITESPACE)
        if not name:
            continue
        count += 1
        if count > MAX_REQUEST_HEADERS:
            raise BadPreflight(
                f"Access-Control-Request-Headers names over {MAX_REQUEST_HEADERS} headers"
            )
        if len(name) > MAX_HEADER_NAME:
            raise BadPreflight(f"a requested header name is over {MAX_HEADER_NAME} characters")
        if not _TOKEN.fullmatch(name):
            raise BadPreflight(f"{name[:MAX_HEADER_NAME]!r} is not a valid header name")
        name = name.lower()
        if name not in known:
            known.add(name)
            extra.append(name)
    return ", ".join([ALLOW_HEADERS, *extra])


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
            requested = headers.getlist("access-control-request-headers")
            try:
                allowed = allow_headers(",".join(requested) if requested else None)
            except BadPreflight as exc:
                extra = {"origin": origin[:200], "path": scope["path"], "reason": str(exc)}
                log.info("preflight refused", extra=extra)
                await _refuse(send, ErrorCode.BAD_REQUEST, str(exc), PREFLIGHT_VARY)
                return
            await _preflight(send, origin, allowed)
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


async def _preflight(send: Send, origin: str, allowed: str) -> None:
    headers = [
        (b"access-control-allow-origin", origin.encode("latin-1", "replace")),
        (b"access-control-expose-headers", EXPOSE_HEADERS.encode()),
        (b"vary", PREFLIGHT_VARY.encode()),
        (b"access-control-allow-methods", ALLOW_METHODS.encode()),
        (b"access-control-allow-headers", allowed.encode()),
        (b"access-control-max-age", MAX_AGE.encode()),
        (b"content-length", b"0"),
    ]
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


async def _forbidden(send: Send, origin: str) -> None:
    shown = origin[:100]
    await _refuse(
        send, ErrorCode.FORBIDDEN, f"Origin {shown!r} is not allowed (see --allow-origin)."
    )


async def _refuse(send: Send, code: ErrorCode, message: str, vary: str = "Origin") -> None:
    """An error answer without CORS headers: the browser blocks the request."""
    err = error_for_code(code, message)
    body = json.dumps(err.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"vary", vary.encode()),
    ]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
