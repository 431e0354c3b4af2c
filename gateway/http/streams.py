"""Resume and cancel a stream over HTTP, whichever transport started it.

- ``GET /v1/streams/{stream_id}/events``: SSE replay of every event after an
  offset (``Last-Event-ID``, else ``?after=``, else the whole stream), then
  the live ones, with no gap and no duplicate, rendered as the stream was
  started (chat or text-completion chunks; chat for a WebSocket stream). The
  resume token comes in the ``X-Resume-Token`` header (it wins), else in
  ``?resume_token=`` (kept for a browser ``EventSource``, which cannot send
  headers; a URL ends up in proxies' logs). At the end of a finished stream:
  204, so an ``EventSource`` stops reconnecting. A resume that is served is
  admitted as a new stream is: a stream slot and a rate-limit request of its
  caller (its key when it sends one, else its address), and a seat among the
  stream's readers here (gateway/streams/readers.py: ``overloaded`` when they
  are all taken and too young to give way; a reader replaced by a newer resume
  ends with a ``forbidden`` error event).
- ``POST /v1/streams/{stream_id}/cancel``: the token in the JSON body, the
  query or the header.

Mounted by gateway/app.py's route list. docs/api.md is the reference.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from tokenrelay.core.wire.errors import NO_SUCH_STREAM, RequestError
from tokenrelay.core.wire.events import Event
from tokenrelay.core.wire.keys import STREAM_ID_RE
from tokenrelay.core.wire.requests import is_request_id, validate_resume_token
from tokenrelay.core.wire.vocabulary import ErrorCode, StreamStatus
from tokenrelay.gateway.access.cors import EXPOSE_HEADERS
from tokenrelay.gateway.access.guard import Principal
from tokenrelay.gateway.errors import (
    STORE_ERRORS,
    AuthError,
    BadOffset,
    RateLimited,
    TooManyStreams,
)
from tokenrelay.gateway.http.common import (
    HttpSettings,
    error_response,
    event_frames,
    load_format,
    read_body,
    store_error,
)
from tokenrelay.gateway.http.openai_render import ChunkEncoder, StreamFormat
from tokenrelay.gateway.http.openai_request import (
    ApiError,
    error_for_code,
    parse_json,
    request_error,
)
from tokenrelay.gateway.http.sse import parse_event_id
from tokenrelay.gateway.http.sse_response import Pump, SSEResponse
from tokenrelay.gateway.streams.readers import Seat

if TYPE_CHECKING:
    from tokenrelay.gateway.state import Gateway

log = logging.getLogger("tokenrelay.api")


def resume_token(request: Request, body: dict[str, Any] | None = None) -> str:
    """The token from the ``X-Resume-Token`` header, the query or the body; else a 401.

    Its shape is checked as on the WebSocket (:func:`validate_resume_token`): a 400.
    """
    token: Any = request.headers.get("x-resume-token")
    name = "X-Resume-Token"
    if not token:
        token, name = request.query_params.get("resume_token"), "resume_token"
    if not token and body is not None:
        token, name = body.get("resume_token"), "resume_token"
    if token is None or token == "":
        where = "an X-Resume-Token header, ?resume_token="
        where += " or 'resume_token' in the body" if body is not None else ""
        raise error_for_code(ErrorCode.UNAUTHORIZED, f"Missing resume token: pass {where}.")
    try:
        return validate_resume_token(token, name)
    except RequestError as exc:
        raise request_error(exc) from None


def stream_id_of(request: Request) -> str:
    sid = str(request.path_params["stream_id"])
    if not STREAM_ID_RE.fullmatch(sid):
        raise error_for_code(ErrorCode.NOT_FOUND, NO_SUCH_STREAM)
    return sid


def offset_of(request: Request) -> int:
    """``Last-Event-ID`` (an EventSource reconnecting) wins over ``?after=``; default -1."""
    try:
        header = parse_event_id(request.headers.get("last-event-id"))
        query = parse_event_id(request.query_params.get("after"))
    except ValueError as exc:
        raise error_for_code(ErrorCode.BAD_REQUEST, str(exc), param="after") from None
    after = header if header is not None else query if query is not None else -1
    if after < -1:
        raise error_for_code(ErrorCode.BAD_REQUEST, "'after' must be >= -1", param="after")
    return after


@dataclass
class Reader:
    """What one SSE resume holds while it reads: a stream slot, a seat, an attachment."""

    stream_id: str
    bucket: str = ""  # its caller's stream slot ("": none taken)
    seat: Seat | None = None
    attach_id: str | None = None
    replaced: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )  # done once a newer resume took the seat
    released: bool = False

    def replace(self) -> None:
        if not self.replaced.done():
            self.replaced.set_result(None)


class StreamsApi:
    """Resume and cancel for one gateway process."""

    def __init__(self, gw: Gateway, settings: HttpSettings | None = None) -> None:
        self.gw = gw
        self.settings = settings or HttpSettings.of(gw)
        self.model = gw.settings.model_name or "default"

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/streams/{stream_id}/events", self.events, methods=["GET"]),
            Route("/v1/streams/{stream_id}/cancel", self.cancel, methods=["POST"]),
        ]

    async def events(self, request: Request) -> Response:
        """``GET /v1/streams/{stream_id}/events``: replay after an offset, then tail."""
        streams = self.gw.streams
        reader: Reader | None = None
        sid: str | None = None
        try:
            sid = stream_id_of(request)
            token = resume_token(request)
            after = offset_of(request)
            who = self._caller(request)
            info = await streams.authorize(sid, token)
            last = info.last_seq
            if info.status == StreamStatus.DONE and last is not None and after >= last:
                if after > last:
                    raise BadOffset(f"after={after} is beyond the last event (seq {last})")
                return Response(status_code=204, headers={"X-Stream-Id": sid})
            if after >= 0:
                await streams.check_after(sid, after)
            fmt = StreamFormat.decode(
                await load_format(streams, sid), model=self.model, created=int(time.time())
            )
            reader = Reader(sid)
            await self._admit(who, reader)
            if info.status != StreamStatus.DONE:
                reader.attach_id = await streams.attach(sid)
            answer = self._replay(request, sid, after, info.request_id, fmt, reader)
            reader = None  # the answer's cleanup releases it now
            return answer
        except (ApiError, *STORE_ERRORS) as exc:
            error = exc if isinstance(exc, ApiError) else store_error(exc)
            refused = {"stream_id": sid, "status": error.status, "reason": error.message[:200]}
            log.info("resume refused", extra=refused)
            return error_response(error)
        finally:  # what no answer took (something failed) goes back at once
            if reader is not None:
                await self._release(reader)

    def _caller(self, request: Request) -> Principal:
        """Whose limits a resume counts against: its key when it sends one, else its address."""
        address = request.client.host if request.client else "?"
        try:
            return self.gw.guard.resumer(request.headers, address)
        except AuthError as exc:
            raise error_for_code(ErrorCode.UNAUTHORIZED, str(exc)) from None

    async def _admit(self, who: Principal, reader: Reader) -> None:
        """A stream slot and a rate-limit request of the caller, then a seat among the
        stream's readers; raises :class:`ApiError` (429) or :class:`TooManyReaders`."""
        guard = self.gw.guard
        try:
            reader.bucket = guard.open_stream(who)  # --max-streams-per-key (per address)
            await guard.admit(who)  # --rate-limit (--rate-limit-per-address)
        except TooManyStreams as exc:
            raise error_for_code(ErrorCode.RATE_LIMITED, str(exc), retry_after=1) from None
        except RateLimited as exc:
            raise error_for_code(
                ErrorCode.RATE_LIMITED, str(exc), retry_after=exc.retry_after
            ) from None
        reader.seat = self.gw.readers.take(reader.stream_id, reader.replace)

    async def _release(self, reader: Reader) -> None:
        """Give back what a resume held (once)."""
        if reader.released:
            return
        reader.released = True
        self.gw.guard.close_stream(reader.bucket)
        self.gw.readers.leave(reader.seat)
        await self.gw.streams.detach(reader.stream_id, reader.attach_id)

    def _replay(
        self,
        request: Request,
        sid: str,
        after: int,
        rid: str | None,
        fmt: StreamFormat,
        reader: Reader,
    ) -> Response:
        """The SSE answer of a resume; its cleanup releases ``reader`` however it ends."""
        streams = self.gw.streams
        usage = request.query_params.get("include_usage")
        if usage is not None:
            fmt = dataclasses.replace(fmt, include_usage=usage.lower() in ("1", "true"))
        extra = {"request_id": rid, "stream_id": sid, "after": after}
        log.info("resume", extra=extra)
        encoder = ChunkEncoder(fmt, sid)
        pump: Pump[Event] = Pump(streams.tail(sid, after, resumed=True))
        cleaned = False

        async def cleanup() -> None:  # once: the frames' finally and the response's on_close
            nonlocal cleaned
            if not cleaned:
                cleaned = True
                await pump.aclose()
                await self._release(reader)

        frames = event_frames(encoder, pump, [], extra, cleanup, reader.replaced)
        headers = {"X-Stream-Id": sid, "Access-Control-Expose-Headers": EXPOSE_HEADERS}
        if is_request_id(rid):  # (a stream stored before request ids were checked: left out)
            headers["X-Request-Id"] = str(rid)
        return SSEResponse(frames, headers=headers, keepalive=self.settings.keepalive,
                           log_extra=extra, on_close=cleanup)  # fmt: skip

    async def cancel(self, request: Request) -> Response:
        """``POST /v1/streams/{stream_id}/cancel``: stop generating (idempotent)."""
        try:
            sid = stream_id_of(request)
            raw = await read_body(request, self.gw.settings.max_frame_bytes)
            token = resume_token(request, parse_json(raw) if raw.strip() else {})
            before = await self.gw.streams.authorize(sid, token)
            info = await self.gw.streams.cancel(sid)
        except ApiError as exc:
            return error_response(exc)
        except STORE_ERRORS as exc:
            return error_response(store_error(exc))
        except ClientDisconnect:
            return Response(status_code=400)
        done = before.status == StreamStatus.DONE
        log.info("cancel", extra={"stream_id": sid, "request_id": info.request_id, "done": done})
        return JSONResponse(
            {
                "stream_id": sid,
                "state": "finished" if done else "cancelling",
                "finish_reason": info.finish_reason if done else None,
            }
        )


def routes(gw: Gateway) -> list[BaseRoute]:
    """Resume and cancel (listed in gateway/app.py)."""
    return StreamsApi(gw).routes()
