"""``n`` > 1: one stream per choice, one OpenAI answer for all of them.

Each choice is its own stream (its own stream id, resume token and seq), queued
as its own request with the same prompt: a worker runs them together and the
later ones take the prompt's KV blocks from its prefix cache as soon as the first
has computed them (engine/scheduling/scheduler.py), so the prompt is prefilled
once. With a ``seed``, choice ``i`` samples with ``seed + i``, so the choices
differ and the answer is reproducible; greedy choices are all the same.

The answer: ``choices[i]`` is stream ``i`` (``X-Stream-Id`` and ``X-Resume-Token``
list the streams in choice order, comma-separated). Streamed, the chunks of all
choices interleave as they come, each with its ``index`` and the ``id:`` of its
event within its own stream; ``[DONE]`` (and the usage chunk, when asked for)
comes once, after the last choice ends. A dropped client resumes each stream on
its own (``GET /v1/streams/{id}/events``), which renders that choice's index.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenrelay.core.wire.events import Event
from tokenrelay.core.wire.requests import MAX_SEED
from tokenrelay.core.wire.vocabulary import EventKind, FinishReason
from tokenrelay.gateway.access.cors import EXPOSE_HEADERS
from tokenrelay.gateway.errors import STORE_ERRORS
from tokenrelay.gateway.http.common import START_WAIT, error_response, save_format, store_error
from tokenrelay.gateway.http.openai_body import Collector, answer_body
from tokenrelay.gateway.http.openai_render import (
    ChunkEncoder,
    StreamFormat,
    dumps,
    stream_error,
    usage,
)
from tokenrelay.gateway.http.openai_request import ApiError, ApiRequest
from tokenrelay.gateway.http.sse import DONE, encode_event
from tokenrelay.gateway.http.sse_response import GONE, Pump, SSEResponse, watch_disconnect

if TYPE_CHECKING:
    from tokenrelay.gateway.access.auth import Principal
    from tokenrelay.gateway.http.openai import OpenAIApi


log = logging.getLogger("tokenrelay.api")

__all__ = ["Choice", "answer_choices", "choice_body", "collect_choices", "stream_choices"]


@dataclasses.dataclass
class Choice:
    """One choice's stream: its id, format (with its ``index``) and live tail."""

    stream_id: str
    fmt: StreamFormat
    pump: Pump[Event]


def choice_body(body: dict[str, Any], index: int) -> dict[str, Any]:
    """The worker request of choice ``index``: the seed moved on by ``index``."""
    params = dict(body["params"])
    if params.get("seed") is not None:
        params["seed"] = (params["seed"] + index) % MAX_SEED
    return {**body, "params": params}


async def collect_choices(choices: list[Choice], gone: asyncio.Task[None]) -> bytes | None:
    """The non-streaming body of all choices (None: the client left first).

    Raises :class:`ApiError` when a choice was rejected or failed.
    """

    async def one(choice: Choice) -> Collector:
        collector = Collector(choice.fmt, choice.stream_id)
        while True:
            item = await choice.pump.next(None)
            if isinstance(item, Event) and collector.add(item):
                return collector

    tasks = [asyncio.ensure_future(one(c)) for c in choices]
    everything: asyncio.Future[list[Collector]] = asyncio.gather(*tasks)
    try:
        waits: list[asyncio.Future[Any]] = [everything, gone]
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if everything not in done:
            return None
        collectors = everything.result()
    except STORE_ERRORS as exc:
        raise store_error(exc) from None
    except StopAsyncIteration:
        raise ApiError(500, "the stream ended early", type="server_error") from None
    finally:
        for task in tasks:
            task.cancel()
        everything.cancel()
    return answer_body(collectors)


def _without_done(data: bytes) -> bytes:
    return data[: -len(DONE)] if data.endswith(DONE) else data


async def stream_choices(
    choices: list[Choice],
    first: Event | None,
    include_usage: bool,
    extra: dict[str, Any],
    cleanup: Callable[[], Awaitable[None]],
) -> AsyncGenerator[bytes, None]:
    """SSE bytes of every choice as its events come; ``cleanup`` runs however it ends.

    ``first``: choice 0's first event, already read (the worker's verdict).
    """
    queue: asyncio.Queue[tuple[int, Event | BaseException | None]] = asyncio.Queue()
    encoders = [ChunkEncoder(c.fmt, c.stream_id) for c in choices]

    async def feed(i: int, choice: Choice) -> None:
        try:
            while not encoders[i].finished:
                item = await choice.pump.next(None)
                if isinstance(item, Event):
                    await queue.put((i, item))
                    if item.kind == EventKind.DONE or (
                        item.kind == EventKind.REJECTED and item.code != FinishReason.CANCELLED
                    ):
                        break
        except StopAsyncIteration:
            pass
        except Exception as exc:
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(feed(i, c)) for i, c in enumerate(choices)]
    last: dict[int, Event] = {}
    try:
        if first is not None:
            yield _without_done(encoders[0].encode(first))
        left = len(choices)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Event):
                if item.kind == EventKind.DONE:
                    last[i] = item
                yield _without_done(encoders[i].encode(item))
            elif isinstance(item, STORE_ERRORS):
                log.warning("a choice's stream failed while streaming", extra=extra)
                yield encoders[i].error(store_error(item, streaming=True), final=False)
                return
            else:
                raise item
        if include_usage and last:
            prompt = max(ev.prompt_tokens for ev in last.values())
            completion = sum(ev.completion_tokens for ev in last.values())
            total = Event(0, EventKind.DONE, prompt_tokens=prompt, completion_tokens=completion)
            fmt = choices[0].fmt
            chunk = {"id": encoders[0].id, "object": fmt.object, "created": fmt.created,
                     "model": fmt.model, "choices": [], "usage": usage(total)}  # fmt: skip
            yield encode_event(dumps(chunk))
        yield DONE
        log.info("stream finished", extra=extra)
    finally:
        for task in tasks:
            task.cancel()
        await cleanup()


async def answer_choices(
    api: OpenAIApi, request: Request, req: ApiRequest, kind: str, rid: str, model: str | None,
    who: Principal, slot: str,
) -> Response:  # fmt: skip
    """Start ``req.n`` streams and answer with all of them; ``slot``: the client's slot
    the caller took for the first choice (this answer releases it, as its own).

    Raises :class:`ApiError` before any stream exists when a slot or a stream is refused.
    """
    slots: list[str] = [slot]
    made = []
    try:
        for _ in range(req.n - 1):  # the caller's slot is the first choice's
            slots.append(api.take_slot(who))
        for i in range(req.n):
            made.append(
                await api.gw.streams.create(
                    choice_body(req.body, i),
                    rid,
                    model=model,
                    traceparent=request.headers.get("traceparent"),
                    detach_timeout=req.detach_timeout,
                    owner=api.gw.guard.log_owner(who),
                )
            )
    except (ApiError, *STORE_ERRORS) as exc:
        for new in made:  # never leave a choice running for nobody
            with contextlib.suppress(*STORE_ERRORS):
                await api.gw.streams.cancel(new.stream_id)
            await api.gw.streams.detach(new.stream_id, new.attach_id)
        for slot in slots:
            api.release(slot)
        raise exc if isinstance(exc, ApiError) else store_error(exc) from None
    sids = [new.stream_id for new in made]
    extra: dict[str, Any] = {"request_id": rid, "stream_ids": ",".join(sids), "api": kind,
                             "stream": req.stream, "n": req.n}  # fmt: skip
    log.info("generate", extra=extra)
    created = int(time.time())
    choices = []
    for i, new in enumerate(made):
        fmt = StreamFormat(kind, req.model, created, False, req.logprobs, req.tools, index=i)
        await save_format(api.gw.streams, new.stream_id, fmt, extra)
        choices.append(Choice(new.stream_id, fmt, Pump(api.gw.streams.tail(new.stream_id, -1))))
    cleaned = False

    async def cleanup() -> None:  # once, however the answer ends
        nonlocal cleaned
        if cleaned:
            return
        cleaned = True
        for slot in slots:
            api.release(slot)
        for choice, new in zip(choices, made, strict=True):
            await choice.pump.aclose()
            await api.gw.streams.detach(new.stream_id, new.attach_id)

    headers = {"X-Request-Id": rid, "X-Stream-Id": ",".join(sids),
               "X-Resume-Token": ",".join(new.resume_token for new in made),
               "Access-Control-Expose-Headers": EXPOSE_HEADERS}  # fmt: skip
    gone: asyncio.Task[None] | None = watch_disconnect(request.receive)
    assert gone is not None
    try:
        if not req.stream:
            body = await collect_choices(choices, gone)
            if body is None:
                log.info("client left while waiting; detaching", extra=extra)
                return Response(status_code=499)
            return Response(body, headers=headers, media_type=JSONResponse.media_type)
        first = await _verdict(choices[0], gone)
        if isinstance(first, Response):
            return first
        frames = stream_choices(choices, first, req.include_usage, extra, cleanup)
        answer = SSEResponse(frames, headers=headers, keepalive=api.settings.keepalive,
                             gone=gone, log_extra=extra, on_close=cleanup)  # fmt: skip
        gone = None  # the answer owns it now
        return answer
    except ApiError as exc:
        return error_response(exc, headers)
    finally:
        if gone is not None:
            gone.cancel()
            await cleanup()


async def _verdict(choice: Choice, gone: asyncio.Task[None]) -> Event | Response | None:
    """Choice 0's first event, or the error answer when the worker refused it."""
    try:
        item = await choice.pump.next(START_WAIT, gone)
    except STORE_ERRORS as exc:
        return error_response(store_error(exc))
    except StopAsyncIteration:
        return None
    if item is GONE:
        return Response(status_code=499)
    if (
        isinstance(item, Event)
        and item.kind == EventKind.REJECTED
        and item.code != FinishReason.CANCELLED
    ):
        return error_response(stream_error(item))
    return item if isinstance(item, Event) else None
