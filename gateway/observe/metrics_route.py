"""``GET /metrics`` (Prometheus text format) and the count of HTTP errors by code.

The route is listed in gateway/app.py; gateway/observe/metrics.py
holds the registry. :class:`HttpErrorCounter` is an ASGI middleware that
counts every HTTP error response under ``tokenrelay_errors_total`` with
``transport="http"``: the code is the ``error.code`` of the OpenAI-style JSON
body when there is one, else it follows from the status.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenrelay.core.wire.vocabulary import ErrorCode

if TYPE_CHECKING:
    from tokenrelay.gateway.observe.metrics import GatewayMetrics

STATUS_CODES = {
    400: ErrorCode.BAD_REQUEST,
    401: ErrorCode.UNAUTHORIZED,
    403: ErrorCode.FORBIDDEN,
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.BAD_REQUEST,
    413: ErrorCode.TOO_LARGE,
    429: ErrorCode.RATE_LIMITED,
    503: ErrorCode.UNAVAILABLE,
}
MAX_ERROR_BODY = 16 * 1024  # bytes of an error body looked at for its code


def code_for(status: int, body: bytes) -> str:
    """The protocol error code of an error response."""
    try:
        err = json.loads(body).get("error") if body else None
        code = err.get("code") if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        code = None
    if isinstance(code, str) and code:
        return code
    return STATUS_CODES.get(status, ErrorCode.INTERNAL if status >= 500 else ErrorCode.BAD_REQUEST)


class HttpErrorCounter:
    """ASGI middleware: counts HTTP responses with status >= 400 (499 excepted)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        body = bytearray()

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message.get("status", 0))
            elif (
                status >= 400
                and message["type"] == "http.response.body"
                and len(body) < MAX_ERROR_BODY
            ):
                body.extend(message.get("body", b"")[: MAX_ERROR_BODY - len(body)])
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if status >= 400 and status != 499:  # 499: the client left, nothing was sent
                self.metrics.count_error(code_for(status, bytes(body)), "http")


def routes(registry: GatewayMetrics) -> list[BaseRoute]:
    """``/metrics`` (listed in gateway/app.py)."""

    async def metrics(request: Request) -> Response:
        await registry.refresh()
        return Response(registry.render(), media_type=CONTENT_TYPE_LATEST)

    return [Route("/metrics", metrics, methods=["GET"])]
