"""The OpenAI-compatible HTTP API, with resumable SSE, over the shared stream log.

Routes (mounted by gateway/app.py, which picks up every ``gateway/api_*.py``):

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: streaming (SSE
  chunks with ``id: <seq>``, then ``data: [DONE]``) or not.
- ``GET /v1/models`` and ``GET /v1/models/{model}``.
- ``GET /v1/streams/{stream_id}/events``: resume (``Last-Event-ID`` or
  ``?after=``; the resume token in ``?resume_token=`` or ``X-Resume-Token``).
- ``POST /v1/streams/{stream_id}/cancel``.

A request becomes a stream in the same :class:`gateway.streamlog.StreamLog` as
a WebSocket ``generate``: a stream started here resumes over the WebSocket and
the other way round. A client that goes away is a disconnect (the stream keeps
generating for ``--detach-timeout`` seconds), never a cancel.

Environment (read when the app is built): ``TOKENRELAY_API_KEYS`` (comma
separated; when set, completions and models need ``Authorization: Bearer``),
``TOKENRELAY_HTTP_MAX_STREAMS_PER_CLIENT`` (concurrent generations per API key
or client address, default 256; more get 429) and ``TOKENRELAY_SSE_KEEPALIVE``
(seconds of silence before a ``: keep-alive`` comment, default 10).
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import secrets
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.http_sse import GONE, Pump, SSEResponse, watch_disconnect
from gateway.openai_schema import (
    ApiError,
    ApiRequest,
    error_for_code,
    parse_chat,
    parse_completion,
    parse_json,
)
from gateway.openai_stream import (
    ChunkEncoder,
    Collector,
    StreamFormat,
    model_card,
    models_body,
    stream_error,
)
from gateway.redisconn import is_outage
from gateway.schema import STREAM_ID_RE, Event
from gateway.sse import parse_event_id
from gateway.streamlog import (
    BadOffset,
    NoWorker,
    Overloaded,
    RedisUnavailable,
    StreamForbidden,
    StreamNotFound,
)

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger("tokenrelay.api")

START_WAIT = 5.0  # seconds to wait for the worker's verdict before committing to a 200
FORMAT_FIELD = "oa"  # stream metadata field holding the StreamFormat
REQUEST_ID_RE = re.compile(r"^[\x21-\x7e]{1,128}$")
STREAM_HEADERS = "X-Stream-Id, X-Resume-Token, X-Request-Id"


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        raise ValueError(f"{name} must be a number") from None


def error_response(exc: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), exc.status, headers={**exc.headers(), **(headers or {})})


def _store_error(exc: Exception) -> ApiError:
    """The :class:`ApiError` for a stream-log failure."""
    if isinstance(exc, NoWorker):
        return error_for_code("unavailable", str(exc), retry_after=2)
    if isinstance(exc, Overloaded):
        return error_for_code("overloaded", str(exc), retry_after=1)
    if isinstance(exc, StreamNotFound):  # EventsTrimmed included
        return error_for_code("not_found", str(exc) or "no such stream (unknown or expired)")
    if isinstance(exc, StreamForbidden):
        return error_for_code("forbidden", str(exc))
    if isinstance(exc, BadOffset):
        return error_for_code("bad_request", str(exc), param="after")
    return error_for_code("unavailable", "the stream store is unreachable", retry_after=2)


class OpenAIApi:
    """The HTTP API of one gateway process."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.model = gw.settings.model_name or "default"
        self.created = int(time.time())
        self.keepalive = _env_float("TOKENRELAY_SSE_KEEPALIVE", 10.0)
        self.max_per_client = int(_env_float("TOKENRELAY_HTTP_MAX_STREAMS_PER_CLIENT", 256))
        raw_keys = os.environ.get("TOKENRELAY_API_KEYS", "")
        self.api_keys = [k.strip() for k in raw_keys.split(",") if k.strip()]
        self.active: dict[str, int] = {}  # client key -> generations in flight

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model_info, methods=["GET"]),
            Route("/v1/streams/{stream_id}/events", self.events, methods=["GET"]),
            Route("/v1/streams/{stream_id}/cancel", self.cancel, methods=["POST"]),
        ]

    # --- helpers ---------------------------------------------------------------------

    def _client_key(self, request: Request) -> str:
        """Who the per-client limit counts: the API key, else the client address."""
        self._authenticate(request)
        auth = request.headers.get("authorization", "")
        if self.api_keys and auth.lower().startswith("bearer "):
            return "key:" + auth[7:].strip()
        return "addr:" + (request.client.host if request.client else "?")

    def _authenticate(self, request: Request) -> None:
        if not self.api_keys:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if not given:
            raise error_for_code(
                "unauthorized", "Missing API key: send 'Authorization: Bearer <key>'."
            )
        if not any(hmac.compare_digest(given.encode(), k.encode()) for k in self.api_keys):
            raise error_for_code("unauthorized", "Incorrect API key provided.")

    async def _read_body(self, request: Request) -> bytes:
        limit = self.gw.settings.max_frame_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise error_for_code("too_large", f"The request body is over {limit} bytes.")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise error_for_code("too_large", f"The request body is over {limit} bytes.")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _format_of(self, stream_id: str) -> str | None:
        try:
            raw = await self.gw.log.redis.hget(self.gw.log.keys.meta(stream_id), FORMAT_FIELD)
        except Exception as exc:
            if is_outage(exc):
                raise RedisUnavailable("redis is unreachable") from None
            raise
        return raw.decode() if isinstance(raw, bytes) else raw

    async def _save_format(self, stream_id: str, fmt: StreamFormat, extra: dict[str, Any]) -> None:
        try:
            await self.gw.log.redis.hset(
                self.gw.log.keys.meta(stream_id), FORMAT_FIELD, fmt.encode()
            )
        except Exception:  # resuming then renders as chat; never fail the request for it
            log.warning("could not store the stream format", extra=extra, exc_info=True)

    # --- models --------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``."""
        try:
            self._authenticate(request)
        except ApiError as exc:
            return error_response(exc)
        return JSONResponse(models_body(self.model, self.created))

    async def model_info(self, request: Request) -> Response:
        """``GET /v1/models/{model}``."""
        try:
            self._authenticate(request)
        except ApiError as exc:
            return error_response(exc)
        name = request.path_params["model"]
        if name != self.model:
            msg = f"The model `{name[:80]}` does not exist."
            return error_response(ApiError(404, msg, param="model", code="model_not_found"))
        return JSONResponse(model_card(self.model, self.created))

    # --- completions ----------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return await self._generate(request, "completion")

    async def _generate(self, request: Request, kind: str) -> Response:
        rid = request.headers.get("x-request-id", "")
        if not REQUEST_ID_RE.match(rid):
            rid = "req-" + secrets.token_hex(8)
        rid_header = {"X-Request-Id": rid}
        key: str | None = None
        try:
            client = self._client_key(request)
            body = parse_json(await self._read_body(request))
            parse = parse_chat if kind == "chat" else parse_completion
            req = parse(body, served_model=self.model, limits=self.gw.limits)
            if self.active.get(client, 0) >= self.max_per_client:
                raise error_for_code(
                    "rate_limited",
                    f"At most {self.max_per_client} concurrent requests per client.",
                    retry_after=1,
                )
            key = client
            self.active[key] = self.active.get(key, 0) + 1
            try:
                new = await self.gw.log.create(req.body, rid)
            except (NoWorker, Overloaded, RedisUnavailable) as exc:
                raise _store_error(exc) from None
        except ApiError as exc:
            self._release(key)
            log.info("request refused", extra={"request_id": rid, "status": exc.status,
                                               "reason": exc.message})  # fmt: skip
            return error_response(exc, rid_header)
        except ClientDisconnect:
            self._release(key)
            return Response(status_code=400)
        except Exception:
            self._release(key)
            log.exception("request failed", extra={"request_id": rid})
            return error_response(error_for_code("internal", "internal error"), rid_header)
        sid = new.stream_id
        extra = {"request_id": rid, "stream_id": sid, "api": kind, "stream": req.stream}
        if req.user:
            extra["user"] = req.user[:64]
        log.info("generate", extra=extra)
        fmt = StreamFormat(kind, req.model, int(time.time()), req.include_usage)
        await self._save_format(sid, fmt, extra)
        headers = {
            **rid_header,
            "X-Stream-Id": sid,
            "X-Resume-Token": new.resume_token,
            "Access-Control-Expose-Headers": STREAM_HEADERS,
        }
        gone = watch_disconnect(request.receive)
        pump: Pump[Event] = Pump(self.gw.log.tail(sid, -1))

        async def cleanup() -> None:  # the SSE response, or this handler, ends `gone`
            await pump.aclose()
            await self.gw.log.detach(sid, new.attach_id)
            self._release(key)

        if not req.stream:
            try:
                return await self._collect(req, fmt, sid, pump, gone, headers, extra)
            finally:
                gone.cancel()
                await cleanup()
        return await self._start_stream(fmt, sid, pump, gone, headers, extra, cleanup)

    def _release(self, key: str | None) -> None:
        if key is None:
            return
        left = self.active.get(key, 0) - 1
        if left > 0:
            self.active[key] = left
        else:
            self.active.pop(key, None)

    async def _collect(
        self,
        req: ApiRequest,
        fmt: StreamFormat,
        sid: str,
        pump: Pump[Event],
        gone: Any,
        headers: dict[str, str],
        extra: dict[str, Any],
    ) -> Response:
        collector = Collector(fmt, sid)
        try:
            while True:
                item = await pump.next(None, gone)
                if item is GONE:
                    log.info("client disconnected while waiting; detaching", extra=extra)
                    return Response(status_code=499)
                if isinstance(item, Event) and collector.add(item):
                    break
        except ApiError as exc:
            return error_response(exc, headers)
        except (StreamNotFound, RedisUnavailable) as exc:
            return error_response(_store_error(exc), headers)
        except StopAsyncIteration:
            return error_response(error_for_code("internal", "the stream ended early"), headers)
        assert collector.result is not None
        return JSONResponse(collector.result, headers=headers)

    async def _start_stream(
        self,
        fmt: StreamFormat,
        sid: str,
        pump: Pump[Event],
        gone: Any,
        headers: dict[str, str],
        extra: dict[str, Any],
        cleanup: Any,
    ) -> Response:
        """Wait briefly for the worker's verdict, so a rejection is a proper HTTP error."""
        first: Event | None = None
        refusal: Response | None = None
        try:
            item = await pump.next(START_WAIT, gone)
            if item is GONE:
                refusal = Response(status_code=499)
            elif isinstance(item, Event):
                first = item
                if item.kind == "rejected" and item.code != "cancelled":
                    log.info("request rejected by the worker", extra={**extra, "code": item.code})
                    refusal = error_response(stream_error(item), headers)
        except (StreamNotFound, RedisUnavailable) as exc:
            refusal = error_response(_store_error(exc), headers)
        except StopAsyncIteration:
            refusal = error_response(error_for_code("internal", "the stream ended early"), headers)
        if refusal is not None:
            gone.cancel()
            await cleanup()
            return refusal
        encoder = ChunkEncoder(fmt, sid)
        frames = self._frames(encoder, pump, [first] if first else [], extra, cleanup)
        return SSEResponse(
            frames, headers=headers, keepalive=self.keepalive, gone=gone, log_extra=extra
        )

    async def _frames(
        self,
        encoder: ChunkEncoder,
        pump: Pump[Event],
        first: list[Event],
        extra: dict[str, Any],
        cleanup: Any,
    ) -> AsyncGenerator[bytes, None]:
        """SSE bytes for every event until ``done`` (cleanup runs however it ends)."""
        try:
            for ev in first:
                yield encoder.encode(ev)
            while not encoder.finished:
                try:
                    item = await pump.next(None)
                except StopAsyncIteration:
                    return
                if isinstance(item, Event):
                    yield encoder.encode(item)
        except StreamNotFound as exc:
            log.info("stream vanished while streaming", extra=extra)
            yield encoder.error(error_for_code("not_found", str(exc)))
        except RedisUnavailable:
            log.warning("stream store unreachable while streaming", extra=extra)
            msg = "the stream store is unreachable; resume later"
            yield encoder.error(error_for_code("unavailable", msg), final=False)
        finally:
            await cleanup()
        if encoder.finished:
            log.info("stream finished", extra=extra)

    # --- resume and cancel ----------------------------------------------------------

    @staticmethod
    def _token(request: Request, body: dict[str, Any] | None = None) -> str:
        token = request.query_params.get("resume_token") or request.headers.get("x-resume-token")
        if not token and body is not None:
            raw = body.get("resume_token")
            if raw is not None and not isinstance(raw, str):
                raise error_for_code("bad_request", "'resume_token' must be a string",
                                     param="resume_token")  # fmt: skip
            token = raw
        if not token:
            raise error_for_code(
                "unauthorized",
                "Missing resume token: pass ?resume_token=, an X-Resume-Token header"
                + (" or 'resume_token' in the body." if body is not None else "."),
            )
        return token

    @staticmethod
    def _stream_id(request: Request) -> str:
        sid = str(request.path_params["stream_id"])
        if not STREAM_ID_RE.match(sid):
            raise error_for_code("not_found", "no such stream (unknown or expired)")
        return sid

    async def events(self, request: Request) -> Response:
        """``GET /v1/streams/{stream_id}/events``: replay after an offset, then tail."""
        try:
            sid = self._stream_id(request)
            token = self._token(request)
            try:
                header = parse_event_id(request.headers.get("last-event-id"))
                query = parse_event_id(request.query_params.get("after"))
            except ValueError as exc:
                raise error_for_code("bad_request", str(exc), param="after") from None
            after = header if header is not None else query if query is not None else -1
            if after < -1:
                raise error_for_code("bad_request", "'after' must be >= -1", param="after")
            usage_q = request.query_params.get("include_usage")
            info = await self.gw.log.authorize(sid, token)
            if info.status == "done" and info.last_seq is not None and after >= info.last_seq:
                if after > info.last_seq:
                    raise BadOffset(f"after={after} is beyond the last event (seq {info.last_seq})")
                return Response(status_code=204, headers={"X-Stream-Id": sid})
            if after >= 0:
                await self.gw.log.check_after(sid, after)
            fmt = StreamFormat.decode(
                await self._format_of(sid), model=self.model, created=int(time.time())
            )
            attach_id = await self.gw.log.attach(sid) if info.status != "done" else None
        except ApiError as exc:
            return error_response(exc)
        except (StreamNotFound, StreamForbidden, BadOffset, RedisUnavailable) as exc:
            return error_response(_store_error(exc))
        if usage_q is not None:
            fmt = StreamFormat(fmt.kind, fmt.model, fmt.created, usage_q.lower() in ("1", "true"))
        extra = {"request_id": info.request_id, "stream_id": sid, "after": after}
        log.info("resume", extra=extra)
        gone = watch_disconnect(request.receive)
        pump: Pump[Event] = Pump(self.gw.log.tail(sid, after))

        async def cleanup() -> None:
            await pump.aclose()
            await self.gw.log.detach(sid, attach_id)

        frames = self._frames(ChunkEncoder(fmt, sid), pump, [], extra, cleanup)
        headers = {"X-Stream-Id": sid, "Access-Control-Expose-Headers": STREAM_HEADERS}
        if info.request_id:
            headers["X-Request-Id"] = info.request_id
        return SSEResponse(
            frames, headers=headers, keepalive=self.keepalive, gone=gone, log_extra=extra
        )

    async def cancel(self, request: Request) -> Response:
        """``POST /v1/streams/{stream_id}/cancel``: stop generating (idempotent)."""
        try:
            sid = self._stream_id(request)
            raw = await self._read_body(request)
            body = parse_json(raw) if raw.strip() else {}
            token = self._token(request, body)
            before = await self.gw.log.authorize(sid, token)
            info = await self.gw.log.cancel(sid)
        except ApiError as exc:
            return error_response(exc)
        except (StreamNotFound, StreamForbidden, RedisUnavailable) as exc:
            return error_response(_store_error(exc))
        except ClientDisconnect:
            return Response(status_code=400)
        already = before.status == "done"
        log.info("cancel", extra={"stream_id": sid, "request_id": info.request_id,
                                  "already_done": already})  # fmt: skip
        return JSONResponse(
            {
                "stream_id": sid,
                "state": "finished" if already else "cancelling",
                "finish_reason": info.finish_reason if already else None,
            }
        )


def routes(gw: Gateway) -> list[BaseRoute]:
    """The API's routes (found by gateway/app.py's plugin discovery)."""
    return OpenAIApi(gw).routes()
