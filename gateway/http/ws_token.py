"""``POST /v1/ws-token``: a short-lived token for opening the WebSocket from a browser.

Browsers cannot set ``Authorization`` on a WebSocket handshake, and a
long-lived API key must never sit in a URL (proxies and logs keep URLs). So a
page trades its key, over HTTP with ``Authorization: Bearer``, for a signed
token that expires after ``--ws-token-ttl`` seconds (60 by default) and opens
``/v1/ws?token=...``. Any gateway with the same keys accepts it.

With no keys configured the answer is ``{"token": null, "auth_required":
false}``: the WebSocket is open to everyone (from allowed origins).
Mounted by gateway/app.py's route list. docs/api.md is the reference.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from tokenrelay.core.wire.vocabulary import ErrorCode
from tokenrelay.gateway.errors import AuthError
from tokenrelay.gateway.http.common import error_response
from tokenrelay.gateway.http.openai_request import error_for_code

if TYPE_CHECKING:
    from tokenrelay.gateway.access.guard import Guard

log = logging.getLogger("tokenrelay.api")


def routes(guard: Guard) -> list[BaseRoute]:
    """``POST /v1/ws-token`` (listed in gateway/app.py)."""

    async def ws_token(request: Request) -> Response:
        if not guard.auth.enabled:
            return JSONResponse({"token": None, "expires_at": None, "auth_required": False})
        address = request.client.host if request.client else "?"
        try:
            # a bearer key only: a token cannot be traded for a longer-lived one
            who = guard.authenticate(request.headers, {}, address)
        except AuthError as exc:
            return error_response(error_for_code(ErrorCode.UNAUTHORIZED, str(exc)))
        token, expires = guard.auth.issue_token(who.key_id or "")
        log.info("ws token issued", extra={"key_id": who.key_id, "client": address})
        body = {"token": token, "expires_at": expires, "auth_required": True,
                "ttl_s": guard.auth.token_ttl}  # fmt: skip
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    return [Route("/v1/ws-token", ws_token, methods=["POST"])]
