"""One request's streaming HTTP exchange with the upstream, retries included.

:class:`Call` posts the request (worker/upstream/openai.py), reads its server-sent
events and puts each text delta (with its tokens' logprobs when asked for, and its
tool-call deltas) and the finish (with the calls) into the inbox
(worker/upstream/inbox.py) as they arrive. Failures follow worker/upstream/failures.py:
before the first token, transient ones are tried again and then refuse the stream;
after it, the stream ends with ``error`` and says why. Nothing waits forever:
connecting, each read and the pool have the ``--upstream-timeout`` (connect at most
10 s), and each attempt has three deadlines from its request's sending
(worker/upstream/deadlines.py): its response headers, its first text, its end. The
HTTP client is worker/upstream/client.py; the bytes of the body become events in
worker/upstream/openai.py (:class:`SSEStream`, whose caps on lines, events and idle
lines fail the call as a malformed event does).

The call counts the tokens it forwards (the upstream's usage when a chunk carries it,
else one per text delta): once ``max_tokens`` are out, the next text ends the stream
with ``length`` and closes the upstream's answer, whatever the upstream goes on sending.

Cancelling the call's task (an abort: a client's Stop, a detach timeout, a drain)
closes its response, and with it the connection: vLLM and TGI stop generating
when their client goes. A tokenrelay upstream only detaches then (its client may
resume), so a call that has the upstream's ``X-Stream-Id`` and ``X-Resume-Token``
also asks it to cancel that stream, as does a call that gives up on an answer. Both
headers are used only with the shapes tokenrelay gives them (core/wire/keys.py,
core/wire/requests.py): others are logged and ignored, never put into a request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tokenrelay.core.wire.errors import RequestError
from tokenrelay.core.wire.keys import STREAM_ID_RE
from tokenrelay.core.wire.logprobs import Logprobs
from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.requests import validate_resume_token
from tokenrelay.core.wire.schema_verdicts import deferred_verdicts
from tokenrelay.core.wire.vocabulary import ErrorCode, FinishReason
from tokenrelay.worker.errors import (
    Broken,
    ReadTimeout,
    Refused,
    Retryable,
    TransportError,
    UpstreamError,
)
from tokenrelay.worker.upstream.client import HttpClient, Response
from tokenrelay.worker.upstream.config import UpstreamConfig
from tokenrelay.worker.upstream.deadlines import Deadlines
from tokenrelay.worker.upstream.failures import RetryPolicy, parse_retry_after
from tokenrelay.worker.upstream.features import CallReader, top_at_most
from tokenrelay.worker.upstream.inbox import Inbox
from tokenrelay.worker.upstream.openai import (
    Chunk,
    SSEStream,
    mentions_stream_options,
    parse_chunk,
    request_body,
    status_error,
    unrelayed,
)

log = logging.getLogger("tokenrelay.upstream")

MAX_ERROR_BODY = 16_384  # bytes of an error answer read for its message
CANCEL_ATTEMPTS = 3  # tries of a cancel POST (0.1 s, then 0.3 s apart)
CANCEL_TIMEOUT = 5.0


@dataclass
class Upstream:
    """What every call shares: the client, the settings, what was learnt of the server."""

    http: HttpClient
    cfg: UpstreamConfig
    inbox: Inbox
    model: str | None = None
    model_known: bool = False  # ``model`` is settled (given, listed, or none to send)
    listed: list[str] | None = None  # the upstream's model ids, once it listed them
    include_usage: bool = True  # off once the upstream refuses stream_options
    counters: dict[str, int] = field(default_factory=dict)
    background: set[asyncio.Task[None]] = field(default_factory=set)
    _model_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    async def model_name(self) -> str | None:
        """``--upstream-model``, else the first model the upstream lists (asked once)."""
        if self.model_known:
            return self.model
        async with self._model_lock:
            if not self.model_known:
                await self._list_models()
        return self.model

    async def model_for(self, served: str | None) -> str | None:
        """The name sent upstream for a request for the model ``served`` (the name a
        gateway routed it by; ``None``: the request names none)."""
        name = self.cfg.upstream_name(served, self.listed)
        return name if name is not None else await self.model_name()

    async def list_models(self) -> list[str] | None:
        """The upstream's model ids (asked now); ``None`` when it cannot say."""
        async with self._model_lock:
            await self._list_models()
        return self.listed

    async def _list_models(self) -> None:
        try:
            resp, content = await self.http.request(
                "GET", "/models", headers=self.cfg.auth_headers()
            )
        except TransportError as exc:
            raise Retryable(
                ErrorCode.UNAVAILABLE, f"upstream unreachable: {describe(exc)}"
            ) from None
        if resp.status_code >= 500:
            raise status_error(resp.status_code, content, None)
        try:
            data = json.loads(content)["data"] if resp.status_code == 200 else []
            self.listed = [str(m["id"]) for m in data] or None
        except (ValueError, KeyError, IndexError, TypeError):
            self.listed = None
        if self.cfg.model is None:  # not given: the first one listed
            self.model = self.listed[0] if self.listed else None
        self.model_known = True
        log.info("upstream model", extra={"model": self.model, "status": resp.status_code})


def describe(exc: BaseException) -> str:
    """A transport error in a few words: its class, and its message when it has one."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Call:
    """One stream's upstream request; :meth:`run` is its task."""

    def __init__(self, up: Upstream, stream_id: str, body: dict[str, Any]) -> None:
        self.up = up
        self.stream_id = stream_id
        self.body = body
        self.extra = {"stream_id": stream_id}
        self.started = False  # the first token is in: no more attempts
        self.chunks = 0
        self.finish_reason: FinishReason | None = None
        self.usage: tuple[int, int] | None = None
        self.remote: tuple[str, str] | None = None  # a tokenrelay upstream's stream id, token
        self.sent_at = 0.0  # when the attempt's request went out (monotonic)
        self.max_tokens = 0  # the request's: no text is forwarded past them
        self.top_logprobs: int | None = None  # the request's logprobs (None: not asked)
        self.logprobs: list[Logprobs] = []  # of tokens whose text has not come yet
        self.reader = CallReader()  # the answer's tool calls
        self.deadlines = Deadlines(up.cfg)

    async def run(self) -> None:
        """Make the call until it opens and ends, or fails; the inbox hears either way."""
        policy = RetryPolicy()
        try:
            with deferred_verdicts():  # the gateway checked the schemas; not on this loop
                params = SamplingParams(**(self.body.get("params") or {}))
            self.max_tokens, self.top_logprobs = params.max_tokens, params.logprobs
            if names := unrelayed(params, chat="messages" in self.body):
                said = ", ".join(names)
                raise Refused(ErrorCode.BAD_REQUEST, f"not relayed to an upstream server: {said}")
            while True:
                try:
                    await self._attempt(params)
                    return
                except Retryable as exc:
                    self._cancel_remote()  # an answer abandoned before its first token
                    delay = policy.next_delay(exc.retry_after)
                    self.up.count("upstream_retries")
                    if delay is None:
                        said = f"{exc.message} ({policy.attempts} attempts)"
                        raise Retryable(exc.code, said) from None
                    extra = {**self.extra, "code": exc.code, "delay_s": round(delay, 3)}
                    log.info("upstream attempt failed: %s", exc.message, extra=extra)
                    await asyncio.sleep(delay)
                except Refused as exc:
                    if not (mentions_stream_options(exc) and self.up.include_usage):
                        raise
                    self.up.include_usage = False  # counted by chunks from now on
                    log.warning("the upstream refuses stream_options; usage is counted by chunks")
        except asyncio.CancelledError:
            self._cancel_remote()
            raise
        except Broken as exc:
            self._cancel_remote()
            self.up.count("upstream_broken")
            log.warning("upstream stream broken: %s", exc.message, extra=self.extra)
            self.up.inbox.finish(self.stream_id, FinishReason.ERROR, exc.message, self._usage())
        except UpstreamError as exc:
            self._cancel_remote()
            self.up.count("upstream_refused")
            log.info("upstream refused: %s", exc.message, extra={**self.extra, "code": exc.code})
            self.up.inbox.refuse(self.stream_id, exc.code, exc.message)
        except Exception as exc:  # never leave a stream waiting on a call that is gone
            log.exception("upstream call failed", extra=self.extra)
            message = f"upstream relay error: {type(exc).__name__}"
            if self.started:
                self.up.inbox.finish(self.stream_id, FinishReason.ERROR, message, self._usage())
            else:
                self.up.inbox.refuse(self.stream_id, ErrorCode.INTERNAL, message)

    async def _attempt(self, params: SamplingParams) -> None:
        up = self.up
        self.finish_reason, self.usage = None, None  # (an attempt that failed saw no text)
        self.logprobs, self.reader = [], CallReader()
        served = self.body.get("model")
        model = await up.model_for(served if isinstance(served, str) else None)
        path, payload = request_body(self.body, params, model, include_usage=up.include_usage)
        headers = {"Accept": "text/event-stream", "Content-Type": "application/json",
                   **up.cfg.auth_headers()}  # fmt: skip
        content = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        up.count("upstream_requests")
        self.sent_at = time.monotonic()
        try:
            async with (
                self.deadlines.scope(),
                up.http.stream("POST", path, body=content.encode(), headers=headers) as r,
            ):
                self.deadlines.headers_in()
                if r.status_code != 200:
                    raw = await r.read_some(MAX_ERROR_BODY)
                    retry_after = parse_retry_after(r.headers.get("retry-after"))
                    raise status_error(r.status_code, raw, retry_after)
                self.remote = self._remote_ids(r.headers)
                await self._read(r)
        except TimeoutError:  # (the deadlines' scope; the client raises its own errors)
            up.count("upstream_deadlines")
            raise self.deadlines.missed() from None
        except ReadTimeout:
            silence = f"upstream sent nothing for {up.cfg.timeout:g} s"
            if self.started:
                raise Broken(f"{silence}; the answer is cut short") from None
            raise Refused(ErrorCode.UNAVAILABLE, silence) from None
        except TransportError as exc:
            if self.started:
                raise Broken(f"upstream connection lost: {describe(exc)}") from None
            raise Retryable(
                ErrorCode.UNAVAILABLE, f"upstream unreachable: {describe(exc)}"
            ) from None

    def _remote_ids(self, headers: dict[str, str]) -> tuple[str, str] | None:
        """A tokenrelay upstream's ``X-Stream-Id`` and ``X-Resume-Token``, when both are
        there and have the shapes tokenrelay gives them (else logged and ignored: they
        would go into a cancel's path and headers)."""
        sid, token = headers.get("x-stream-id"), headers.get("x-resume-token")
        if not sid or not token:
            return None
        try:
            validate_resume_token(token)
        except RequestError:
            token = ""
        if STREAM_ID_RE.fullmatch(sid) is None or not token:
            said = "upstream sent a malformed X-Stream-Id or X-Resume-Token; not used"
            log.warning(said, extra={**self.extra, "id_chars": len(sid),
                                     "token_chars": len(headers["x-resume-token"])})  # fmt: skip
            return None
        return sid, token

    async def _read(self, resp: Response) -> None:
        cfg = self.up.cfg
        events = SSEStream(max_line=cfg.max_line_bytes, max_event=cfg.max_event_bytes,
                           max_idle_run=cfg.max_idle_run,
                           max_idle_lines=cfg.max_idle_lines)  # fmt: skip
        while body := await resp.read():
            try:
                got = events.feed(body)
            except ValueError as exc:  # past a cap of the event stream
                raise self._unreadable(str(exc)) from None
            for data in got:
                if self._on_event(data):
                    return
        try:
            last = events.close()
        except ValueError as exc:
            raise self._unreadable(str(exc)) from None
        if last is not None and self._on_event(last):
            return
        if self.finish_reason is not None:  # finished, but no [DONE]
            self._finish()
        elif self.started:
            raise Broken("upstream closed the stream before it finished")
        else:
            raise Retryable(ErrorCode.UNAVAILABLE, "upstream closed the stream before any text")

    def _on_event(self, data: str) -> bool:
        """Take one event; True when the stream is over."""
        try:
            chunk = parse_chunk(data)
        except ValueError:
            raise self._unreadable(f"upstream sent a malformed event: {data[:80]!r}") from None
        if chunk.error is not None:
            said = f"upstream error: {chunk.error}"
            if self.started:
                raise Broken(said)
            if chunk.refusal is not None:  # as its HTTP 400 would: not tried again
                raise Refused(chunk.refusal, said)
            raise Retryable(ErrorCode.UNAVAILABLE, said)
        return self._take(chunk)

    def _unreadable(self, said: str) -> UpstreamError:
        """The error of an answer the relay will not read on (malformed, or past a cap)."""
        return Broken(said) if self.started else Refused(ErrorCode.UNAVAILABLE, said)

    def _take(self, chunk: Chunk) -> bool:
        try:
            deltas = self.reader.feed(chunk.calls) if chunk.calls else []
        except ValueError as exc:  # past a cap on tool calls
            raise self._unreadable(str(exc)) from None
        if (chunk.text or deltas) and self._forwarded() >= self.max_tokens:
            return self._cut()
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.logprobs and self.top_logprobs is not None:  # (a text-less chunk's wait)
            self.logprobs += top_at_most(chunk.logprobs, self.top_logprobs)
        if chunk.text or deltas:
            ttft = None if self.started else time.monotonic() - self.sent_at
            if not self.started:
                self.deadlines.text_in()
            self.started = True
            self.chunks += 1
            logprobs, self.logprobs = self.logprobs, []
            self.up.inbox.text(self.stream_id, chunk.text, ttft, logprobs, deltas)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason  # the usage chunk may follow
        if chunk.done:
            if self.finish_reason is None:
                raise Broken("upstream ended the stream without a finish reason")
            self._finish()
            return True
        return False

    def _forwarded(self) -> int:
        """Tokens forwarded so far: the upstream's count when it gave one, else one a delta."""
        counted = self.usage[1] if self.usage is not None else 0
        return max(self.chunks, counted)

    def _cut(self) -> bool:
        """The upstream sends text past ``max_tokens``: the stream ends with ``length``, the
        answer is closed (and a tokenrelay upstream's stream cancelled)."""
        log.info("upstream went on past max_tokens; the stream ends with length",
                 extra={**self.extra, "max_tokens": self.max_tokens})  # fmt: skip
        self.up.count("upstream_cut_at_max_tokens")
        self.finish_reason = FinishReason.LENGTH
        self._finish()
        self._cancel_remote()
        return True

    def _finish(self) -> None:
        self.up.count("upstream_chunks", self.chunks)
        reason = self.finish_reason or FinishReason.STOP
        done = reason in (FinishReason.STOP, FinishReason.TOOL_CALLS)  # (cut calls are none)
        calls = self.reader.calls(self.stream_id) if done else ()
        if reason == FinishReason.TOOL_CALLS and not calls:
            reason = FinishReason.STOP
        self.up.inbox.finish(self.stream_id, reason, None, self._usage(), calls)

    def _usage(self) -> tuple[int, int]:
        return self.usage if self.usage is not None else (0, self.chunks)

    def _cancel_remote(self) -> None:
        """Ask a tokenrelay upstream to cancel its stream (a closed connection only detaches)."""
        if self.remote is None:
            return
        remote, self.remote = self.remote, None
        task = asyncio.get_running_loop().create_task(self._post_cancel(*remote))
        self.up.background.add(task)
        task.add_done_callback(self.up.background.discard)

    async def _post_cancel(self, sid: str, token: str) -> None:
        """POST the cancel; a cancel is idempotent, so a failed try is tried again (a
        pooled connection the upstream had just closed, a proxy's hiccup)."""
        headers = {"X-Resume-Token": token, **self.up.cfg.auth_headers()}
        for attempt in range(CANCEL_ATTEMPTS):
            try:
                resp, _ = await self.up.http.request(
                    "POST", f"/streams/{sid}/cancel", headers=headers, timeout=CANCEL_TIMEOUT,
                    limit=MAX_ERROR_BODY,
                )  # fmt: skip
            except TransportError as exc:
                extra = {**self.extra, "attempt": attempt + 1}
                log.info("upstream cancel failed: %s", describe(exc), extra=extra)
                await asyncio.sleep(0.1 * 3**attempt)
                continue
            extra = {**self.extra, "upstream_stream_id": sid, "status": resp.status_code}
            log.info("upstream stream cancelled", extra=extra)
            return
