"""OpenAI-compatible completions and models over the shared stream log.

Routes (listed in gateway/app.py):
``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming as SSE
chunks with ``id: <seq>`` then ``data: [DONE]``, or not), ``GET /v1/models``
and ``GET /v1/models/{model}`` (the models of the live workers,
gateway/streams/routing.py). gateway/http/streams.py resumes and cancels.

A request becomes a stream in the same :class:`gateway.streams.store.StreamStore` as
a WebSocket ``generate``, so it can be resumed over either transport. A client
that goes away (streaming, or while waiting for a non-streaming answer) is a
disconnect: the stream is detached and keeps generating for
``--detach-timeout`` seconds, exactly as on the WebSocket. docs/api.md is the
reference.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from tokenrelay.core.wire.events import Event
from tokenrelay.core.wire.vocabulary import ErrorCode, EventKind, FinishReason
from tokenrelay.gateway.access.cors import EXPOSE_HEADERS
from tokenrelay.gateway.access.guard import Principal
from tokenrelay.gateway.access.schema_pool import SCHEMAS
from tokenrelay.gateway.errors import (
    STORE_ERRORS,
    AuthError,
    RateLimited,
    TooManyStreams,
    UnknownModel,
)
from tokenrelay.gateway.http.common import (
    START_WAIT,
    HttpSettings,
    error_response,
    event_frames,
    read_body,
    save_format,
    store_error,
)
from tokenrelay.gateway.http.openai_body import Collector
from tokenrelay.gateway.http.openai_choices import answer_choices
from tokenrelay.gateway.http.openai_render import (
    ChunkEncoder,
    StreamFormat,
    model_card,
    stream_error,
)
from tokenrelay.gateway.http.openai_request import (
    ApiError,
    error_for_code,
    parse_chat,
    parse_completion,
    parse_json,
    request_error,
    request_id_header,
)
from tokenrelay.gateway.http.sse_response import GONE, Pump, SSEResponse, watch_disconnect
from tokenrelay.gateway.streams.routing import Route as ModelRoute

if TYPE_CHECKING:
    from tokenrelay.gateway.state import Gateway

log = logging.getLogger("tokenrelay.api")


@dataclass
class Running:
    """A request whose stream exists: what serving its answer needs."""

    stream_id: str
    fmt: StreamFormat
    pump: Pump[Event]
    gone: asyncio.Task[None]  # ends when the client disconnects
    headers: dict[str, str]
    extra: dict[str, Any]  # log fields
    cleanup: Callable[[], Awaitable[None]]  # close the tail, detach, free the client's slot

    async def abort(self) -> None:
        self.gone.cancel()
        await self.cleanup()


class OpenAIApi:
    """Completions and models for one gateway process."""

    def __init__(self, gw: Gateway, settings: HttpSettings | None = None) -> None:
        self.gw = gw
        self.settings = settings or HttpSettings.of(gw)
        self.created = int(time.time())
        self.active: dict[str, int] = {}  # client key -> generations in flight

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model_info, methods=["GET"]),
        ]

    # --- clients -----------------------------------------------------------------------

    def _authenticate(self, request: Request) -> Principal:
        """The caller (its key id, or its address when no keys are configured), or a 401."""
        address = request.client.host if request.client else "?"
        try:
            return self.gw.guard.authenticate(request.headers, {}, address)
        except AuthError as exc:
            raise error_for_code(ErrorCode.UNAUTHORIZED, str(exc)) from None

    async def _admit(self, who: Principal, cost: int = 1) -> None:
        """The caller's requests-per-minute budget (``--rate-limit``; ``n`` choices cost
        ``n``), or a 429."""
        try:
            await self.gw.guard.admit(who, cost)
        except RateLimited as exc:
            raise error_for_code(
                ErrorCode.RATE_LIMITED, str(exc), retry_after=exc.retry_after
            ) from None

    def take_slot(self, who: Principal) -> str:
        """Count one more generation for the caller (its API key, else its address)."""
        client = who.bucket
        if self.active.get(client, 0) >= self.settings.max_per_client:
            limit = self.settings.max_per_client
            raise error_for_code(
                ErrorCode.RATE_LIMITED,
                f"At most {limit} concurrent requests per client.",
                retry_after=1,
            )
        try:
            self.gw.guard.open_stream(who)  # --max-streams-per-key, WebSocket included
        except TooManyStreams as exc:
            raise error_for_code(ErrorCode.RATE_LIMITED, str(exc), retry_after=1) from None
        self.active[client] = self.active.get(client, 0) + 1
        return client

    def release(self, client: str | None) -> None:
        if client is None:
            return
        self.gw.guard.close_stream(client)
        left = self.active.get(client, 0) - 1
        if left > 0:
            self.active[client] = left
        else:
            self.active.pop(client, None)

    # --- models --------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the models of the live workers."""
        try:
            self._authenticate(request)
            served = await self.gw.models.served()
        except ApiError as exc:
            return error_response(exc)
        except STORE_ERRORS as exc:
            return error_response(store_error(exc))
        cards = [model_card(name, self.created) for name in served.names()]
        return JSONResponse({"object": "list", "data": cards})

    async def model_info(self, request: Request) -> Response:
        """``GET /v1/models/{model}``."""
        try:
            self._authenticate(request)
        except ApiError as exc:
            return error_response(exc)
        name = str(request.path_params["model"])
        try:
            served = await self.gw.models.served()
            if name not in served.names():
                served = await self.gw.models.served(fresh=True)
        except STORE_ERRORS as exc:
            return error_response(store_error(exc))
        if name not in served.names():
            msg = f"The model `{name[:80]}` does not exist."
            return error_response(ApiError(404, msg, param="model", code="model_not_found"))
        return JSONResponse(model_card(name, self.created))

    async def _route(self, body: dict[str, Any]) -> ModelRoute:
        """Where a request for ``body``'s model goes (a 404 for a model nobody serves)."""
        requested = body.get("model")
        try:
            _, route = await self.gw.models.resolve(
                requested if isinstance(requested, str) else None
            )
        except UnknownModel as exc:
            raise ApiError(404, str(exc), param="model", code="model_not_found") from None
        except STORE_ERRORS as exc:
            raise store_error(exc) from None
        return route

    # --- completions ---------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return await self._generate(request, "completion")

    async def _generate(self, request: Request, kind: str) -> Response:
        rid = "req-" + secrets.token_hex(8)  # unless the client sent a valid X-Request-Id
        received = time.time_ns() if self.gw.streams.tracing is not None else None
        client: str | None = None
        try:
            who = self._authenticate(request)
            rid = request_id_header(request.headers.get("x-request-id"), self.gw.limits) or rid
            body = parse_json(await read_body(request, self.gw.settings.max_frame_bytes))
            parse = parse_chat if kind == "chat" else parse_completion
            route = await self._route(body)
            req = await SCHEMAS.parse(  # the schemas are checked off the loop
                lambda: parse(body, served_model=route.name, limits=self.gw.limits),
                lambda _, exc: request_error(exc),
            )
            client = self.take_slot(who)
            await self._admit(who, req.n)
            if req.n > 1:  # one stream per choice (gateway/http/openai_choices.py)
                slot, client = client, None  # its slot goes with the answer
                return await answer_choices(self, request, req, kind, rid, route.model, who, slot)
            try:
                new = await self.gw.streams.create(
                    req.body,
                    rid,
                    model=route.model,
                    traceparent=request.headers.get("traceparent"),
                    received_ns=received,
                    detach_timeout=req.detach_timeout,
                    owner=self.gw.guard.log_owner(who),
                )
            except STORE_ERRORS as exc:
                raise store_error(exc) from None
        except ApiError as exc:
            self.release(client)
            refused = {"request_id": rid, "status": exc.status, "reason": exc.message}
            log.info("request refused", extra=refused)
            return error_response(exc, {"X-Request-Id": rid})
        except ClientDisconnect:
            self.release(client)
            return Response(status_code=400)
        except Exception:
            self.release(client)
            log.exception("request failed", extra={"request_id": rid})
            return error_response(error_for_code(ErrorCode.INTERNAL, "internal error"))
        sid = new.stream_id
        extra: dict[str, Any] = {"request_id": rid, "stream_id": sid, "api": kind,
                                 "stream": req.stream}  # fmt: skip
        if req.user:
            extra["user"] = req.user[:64]
        log.info("generate", extra=extra)
        fmt = StreamFormat(
            kind, req.model, int(time.time()), req.include_usage, req.logprobs, req.tools
        )
        await save_format(self.gw.streams, sid, fmt, extra)
        pump: Pump[Event] = Pump(self.gw.streams.tail(sid, -1))

        cleaned = False

        async def cleanup() -> None:  # once, however the answer ends
            nonlocal cleaned
            if cleaned:
                return
            cleaned = True
            self.release(client)
            await pump.aclose()
            await self.gw.streams.detach(sid, new.attach_id)

        headers = {"X-Request-Id": rid, "X-Stream-Id": sid, "X-Resume-Token": new.resume_token,
                   "Access-Control-Expose-Headers": EXPOSE_HEADERS}  # fmt: skip
        run = Running(sid, fmt, pump, watch_disconnect(request.receive), headers, extra, cleanup)
        if req.stream:
            try:
                return await self._stream(run)
            except BaseException:  # no answer carries the cleanup: run it here
                await run.abort()
                raise
        try:
            return await self._collect(run)
        finally:
            await run.abort()

    async def _collect(self, run: Running) -> Response:
        """A non-streaming answer: wait for the whole completion."""
        collector = Collector(run.fmt, run.stream_id)
        try:
            while True:
                item = await run.pump.next(None, run.gone)
                if item is GONE:
                    log.info("client left while waiting; detaching", extra=run.extra)
                    return Response(status_code=499)
                if isinstance(item, Event) and collector.add(item):
                    break
        except ApiError as exc:
            log.info("request failed", extra={**run.extra, "reason": exc.message})
            return error_response(exc, run.headers)
        except STORE_ERRORS as exc:
            return error_response(store_error(exc), run.headers)
        except StopAsyncIteration:
            return error_response(error_for_code(ErrorCode.INTERNAL, "the stream ended early"))
        return Response(collector.body(), headers=run.headers, media_type=JSONResponse.media_type)

    async def _stream(self, run: Running) -> Response:
        """An SSE answer, once the worker took the request (a rejection is an HTTP error)."""
        first: list[Event] = []
        refusal: Response | None = None
        try:
            item = await run.pump.next(START_WAIT, run.gone)
            if item is GONE:
                refusal = Response(status_code=499)
            elif isinstance(item, Event):
                first.append(item)
                if item.kind == EventKind.REJECTED and item.code != FinishReason.CANCELLED:
                    log.info("rejected by the worker", extra={**run.extra, "code": item.code})
                    refusal = error_response(stream_error(item), run.headers)
        except STORE_ERRORS as exc:
            refusal = error_response(store_error(exc), run.headers)
        except StopAsyncIteration:
            refusal = error_response(error_for_code(ErrorCode.INTERNAL, "the stream ended early"))
        if refusal is not None:
            await run.abort()
            return refusal
        encoder = ChunkEncoder(run.fmt, run.stream_id)
        frames = event_frames(encoder, run.pump, first, run.extra, run.cleanup)
        return SSEResponse(frames, headers=run.headers, keepalive=self.settings.keepalive,
                           gone=run.gone, log_extra=run.extra, on_close=run.cleanup)  # fmt: skip


def routes(gw: Gateway) -> list[BaseRoute]:
    """Completions and models (listed in gateway/app.py)."""
    return OpenAIApi(gw).routes()
