"""What the HTTP API modules share: settings, errors, body reading, stream formats.

gateway/http/openai.py (completions, models) and gateway/http/streams.py
(resume, cancel) both use these. Settings come from the gateway's flags
(see :class:`HttpSettings`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from tokenrelay.core import options
from tokenrelay.core.wire.events import Event
from tokenrelay.core.wire.vocabulary import ErrorCode
from tokenrelay.gateway.errors import ReaderReplaced, RedisUnavailable, StreamNotFound, refusal
from tokenrelay.gateway.http.openai_render import ChunkEncoder, StreamFormat
from tokenrelay.gateway.http.openai_request import ApiError, error_for_code
from tokenrelay.gateway.http.sse_response import GONE, Pump
from tokenrelay.gateway.streams.readers import REPLACED
from tokenrelay.gateway.streams.store import StreamStore

if TYPE_CHECKING:
    from tokenrelay.gateway.state import Gateway

log = logging.getLogger("tokenrelay.api")

FORMAT_FIELD = "oa"  # the stream-metadata field holding the StreamFormat
START_WAIT = 5.0  # seconds to wait for the worker's verdict before committing to a 200


@dataclass(frozen=True)
class HttpSettings:
    """HTTP-API settings: ``--sse-keepalive`` and ``--http-max-streams-per-client``."""

    keepalive: float = options.SSE_KEEPALIVE  # seconds of silence before a keep-alive comment
    max_per_client: int = options.HTTP_MAX_STREAMS_PER_CLIENT  # per API key or client address

    @classmethod
    def of(cls, gw: Gateway) -> HttpSettings:
        """The HTTP settings of gateway ``gw``."""
        s = gw.settings
        return cls(keepalive=s.sse_keepalive, max_per_client=s.http_max_streams_per_client)


def error_response(exc: ApiError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The OpenAI-style JSON error (with ``Retry-After`` for 429/503)."""
    return JSONResponse(exc.body(), exc.status, headers={**exc.headers(), **(headers or {})})


def store_error(exc: Exception, *, streaming: bool = False) -> ApiError:
    """The :class:`ApiError` for a stream-log exception (see :func:`refusal`)."""
    r = refusal(exc, streaming=streaming)
    return error_for_code(r.code, r.message, param=r.param, retry_after=r.retry_after)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is over ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise error_for_code(ErrorCode.TOO_LARGE, f"The request body is over {limit} bytes.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise error_for_code(ErrorCode.TOO_LARGE, f"The request body is over {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


async def load_format(streams: StreamStore, stream_id: str) -> str | None:
    """The stored :class:`StreamFormat` of a stream (None: started over the WebSocket)."""
    return await streams.meta_field(stream_id, FORMAT_FIELD)


async def save_format(
    streams: StreamStore, stream_id: str, fmt: StreamFormat, extra: Mapping[str, Any]
) -> None:
    """Store the format with the stream, so a resume renders the same chunks."""
    try:
        await streams.set_meta_field(stream_id, FORMAT_FIELD, fmt.encode())
    except Exception:  # a resume then renders chat chunks; never fail the request for it
        log.warning("could not store the stream format", extra=dict(extra), exc_info=True)


async def event_frames(
    encoder: ChunkEncoder,
    pump: Pump[Event],
    first: list[Event],
    extra: Mapping[str, Any],
    cleanup: Callable[[], Awaitable[None]],
    replaced: asyncio.Future[None] | None = None,
) -> AsyncGenerator[bytes, None]:
    """SSE bytes for every event until the end; ``cleanup`` runs however it ends.

    ``replaced`` (a resume's seat, gateway/streams/readers.py): once done, a newer resume
    of the stream took this reader's place, and the answer ends with a ``forbidden`` error.
    """
    try:
        for ev in first:
            yield encoder.encode(ev)
        while not encoder.finished:
            try:
                item = await pump.next(None, replaced)
            except StopAsyncIteration:
                return
            if item is GONE:
                log.info("resume replaced by a newer one", extra=dict(extra))
                yield encoder.error(store_error(ReaderReplaced(REPLACED), streaming=True))
                return
            if isinstance(item, Event):
                yield encoder.encode(item)
        log.info("stream finished", extra=dict(extra))
    except StreamNotFound as exc:
        log.info("stream vanished while streaming", extra=dict(extra))
        yield encoder.error(store_error(exc, streaming=True))
    except RedisUnavailable as exc:
        log.warning("stream store unreachable while streaming", extra=dict(extra))
        yield encoder.error(store_error(exc, streaming=True), final=False)
    finally:
        await cleanup()
