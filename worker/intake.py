"""From a queued request to an engine request: checked, tokenized, added.

:class:`Intake` is the worker loop's door. For each request read from the
consumer group it decides what the stream log says first:

- expired or already ended: acknowledged, nothing written;
- running under a worker that died: taken over and continued from the log
  (worker/continuation.py), or ended with ``error`` saying why not (a relay, a log
  without token ids, too many takeovers); ``cancelled`` when a cancel was asked;
- cancelled before it ran: ``rejected cancelled`` then ``done cancelled``;
- bad parameters, or more characters than the engine's context can hold
  (:meth:`core.wire.requests.Limits.for_context`, the bound gateways apply
  too): ``rejected`` then ``done error``, before any tokenizing;
- else it is tokenized (worker/prepare.py: long inputs on a thread, off the
  engine loop, and guided requests there too: their grammar compiles there, once per
  distinct schema) and, once its token ids are back, added to the engine with an
  ``accepted`` event (seq 0). A stream cancelled meanwhile ends as one
  cancelled before it ran.

Reading a request's parameters here leaves llguidance's check of its schemas out
(core/wire/schema_verdicts.py: deferred, and dropped): the gateway checked them, and the
engine's compile on the preparer thread refuses what it cannot build.

An engine with no tokenizer (:class:`worker.engine_client.TakesBody`: the upstream
relay, worker/upstream/) takes the body as is through its own starter in place
of the tokenizer; the request comes back once the engine has it running, or
with the :class:`worker.engine_client.EngineRefused` whose code the stream is
``rejected`` with.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenrelay.core.redis.connection import is_outage
from tokenrelay.core.wire.events import accepted_fields, done_fields, rejected_fields
from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.records import MetaField as M
from tokenrelay.core.wire.requests import Limits
from tokenrelay.core.wire.schema_verdicts import deferred_verdicts
from tokenrelay.core.wire.vocabulary import ErrorCode, FinishReason, StreamStatus, ToolFormat
from tokenrelay.worker import continuation
from tokenrelay.worker.continuation import Continuation
from tokenrelay.worker.engine_client import EngineClient, MakesGuides, Starter, TakesBody
from tokenrelay.worker.errors import EngineRefused
from tokenrelay.worker.outbox import Active
from tokenrelay.worker.prepare import GUIDED, Prepared, Preparer, input_chars
from tokenrelay.worker.store import Request, WorkerStore
from tokenrelay.worker.telemetry import WorkerTelemetry

log = logging.getLogger("tokenrelay.worker")


class Intake:
    """Admits requests into ``active`` (the outbox's streams) and the engine."""

    def __init__(
        self,
        engine: EngineClient,
        store: WorkerStore,
        active: dict[str, Active],
        counters: dict[str, int],
        telemetry: WorkerTelemetry,
        *,
        detach_timeout: float,
        stream_ttl: float,
    ) -> None:
        self.engine = engine
        self.store = store
        self.active = active
        self.counters = counters
        self.telemetry = telemetry
        self.worker_id = store.worker_id
        self.detach_timeout = detach_timeout
        self.stream_ttl = stream_ttl
        guide = engine.guided_matcher if isinstance(engine, MakesGuides) else None
        self.preparer: Starter = (
            engine.starter()
            if isinstance(engine, TakesBody)
            else Preparer(self.encode, guide=guide)  # grammars compile on its thread
        )
        # streams being tokenized: their params and request metadata
        self.preparing: dict[str, tuple[SamplingParams, dict[str, str]]] = {}
        context = engine.stats().get("max_model_len")
        self.max_input_chars = (
            Limits().for_context(int(context)).max_input_chars if context else None
        )

    def admit_all(self, reqs: list[Request]) -> None:
        for req in reqs:
            try:
                self.admit(req)
            except Exception as exc:  # its stream's master is down (a cluster): it waits
                if not is_outage(exc):
                    raise
                extra = {"stream_id": req.stream_id, "request_id": req.request_id}
                log.warning("request waits: its redis master is down (%r)", exc, extra=extra)

    def admit(self, req: Request) -> None:
        """Take one request: end it at once (see the module doc) or start tokenizing it."""
        meta = req.meta
        ttl = float((meta or {}).get(M.STREAM_TTL) or self.stream_ttl)
        dt = req.detach_timeout if req.detach_timeout is not None else self.detach_timeout
        if req.stream_id in self.active:
            return
        if meta is None or meta.get(M.STATUS) == StreamStatus.DONE:
            self.store.ack([req.entry_id], req.queue)  # expired, or ended before it ran
            return
        going_on = None
        if meta.get(M.STATUS) == StreamStatus.RUNNING:  # taken from a dead worker mid-stream
            going_on = self._take_over(req, meta)
            if going_on is None:
                return
        a = Active(req.stream_id, req.request_id, req.entry_id, dt, ttl, queue=req.queue)
        if going_on is not None:
            a.events, a.written = going_on.events, len(going_on.events)
            a.continued, a.text_chars = going_on.token_ids, going_on.text_chars
            a.text = list(going_on.text)  # the text so far: read back for tool calls
        a.traceparent = req.traceparent
        self.active[a.stream_id] = a
        self.counters["requests"] += 1
        if meta.get(M.CANCEL) == "1":
            self._cancelled_before_start(a)
            return
        try:
            body = req.body
            if body is None:
                raise ValueError("request body is not valid JSON")
            with deferred_verdicts():  # not on this loop: see the module doc
                params = SamplingParams(**(body.get("params") or {}))
        except (ValueError, TypeError) as exc:
            self.reject(a, ErrorCode.BAD_REQUEST, str(exc))
            return
        limit = self.max_input_chars  # the gateways' bound, for requests queued past one
        if limit is not None and (size := input_chars(body)) > limit:
            message = f"input is {size} characters; the limit is {limit} for this model's context"
            self.reject(a, ErrorCode.TOO_LARGE, message)
            return
        self.preparing[a.stream_id] = (params, meta)
        if params.offered_tools:  # the template shows them (a key no client body has)
            body = {**body, "_tools": params.offered_tools}
        guided = params.guided_for(getattr(self.engine, "tool_format", ToolFormat.HERMES))
        if guided is not None:  # its grammar compiles beside the loop
            body = {**body, GUIDED: guided}
        self.preparer.submit(a.stream_id, body)

    def _take_over(self, req: Request, meta: dict[str, str]) -> Continuation | None:
        """Own a dead worker's running stream and read its log (worker/continuation.py);
        None when it does not go on here (ended with a clear outcome, or not ours)."""
        sid, old = req.stream_id, meta.get(M.WORKER, "?")
        extra = {"stream_id": sid, "request_id": req.request_id, "dead_worker": old}
        if isinstance(self.engine, TakesBody):  # an upstream cannot resume mid-answer
            self._end_foreign(req, meta, FinishReason.ERROR,
                              f"engine worker {old} stopped responding")  # fmt: skip
            return None
        if meta.get(M.CANCEL) == "1":  # cancelled meanwhile: not revived
            self._end_foreign(req, meta, FinishReason.CANCELLED, None)
            return None
        takeovers = continuation.take_over(self.store, sid, old)
        if takeovers == 0:  # no longer running under that worker: ended, or not ours
            self.store.ack([req.entry_id], req.queue)
            log.info("stream not taken over: it moved on", extra=extra)
            return None
        found = continuation.plan(continuation.read_log(self.store, sid), takeovers)
        if found == "done":
            self.store.ack([req.entry_id], req.queue)
            return None
        if isinstance(found, str):
            log.warning("stream cannot be continued: %s", found, extra=extra)
            self._end_foreign(req, meta, FinishReason.ERROR,
                              f"engine worker {old} stopped responding; {found}")  # fmt: skip
            return None
        log.warning(
            "continuing the stream of a dead worker",
            extra={**extra, "from_seq": len(found.events), "tokens": len(found.token_ids),
                   "takeovers": takeovers},
        )  # fmt: skip
        self.counters["continued"] += 1
        return found

    def _end_foreign(
        self, req: Request, meta: dict[str, str], reason: FinishReason, message: str | None
    ) -> None:
        if continuation.finish_foreign(self.store, req.stream_id, reason, message or ""):
            self.telemetry.ended_foreign(req.stream_id, req.request_id, meta)
        self.store.ack([req.entry_id], req.queue)

    def encode(self, body: dict[str, Any]) -> list[int]:
        """A request body's prompt token ids (on the preparer's thread for long ones)."""
        if "messages" in body:
            return self.engine.apply_chat_template(body["messages"], body.get("_tools", ()))
        prompt: Any = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            return self.engine.encode(prompt)
        return prompt  # type: ignore[no-any-return]  # token ids (or junk): add_request checks

    def start_prepared(self) -> bool:
        """Hand the tokenized requests to the engine; whether any stream has news."""
        news = False
        for sid in [s for s in self.preparing if self._cancelled(s)]:
            self.forget(sid)  # cancelled while it was tokenized (or started upstream)
            self._cancelled_before_start(self.active[sid])
            news = True
        for prepared in self.preparer.take():
            a = self.active.get(prepared.stream_id)
            waiting = self.preparing.pop(prepared.stream_id, None)
            if a is None or a.final or a.silent or waiting is None:
                self.preparer.forget(prepared.stream_id)  # a starter lets its request go
                continue
            news = True
            self._add(a, prepared, *waiting)
        return news

    def _cancelled(self, stream_id: str) -> bool:
        a = self.active.get(stream_id)
        return a is not None and a.abort_reason is not None and not (a.final or a.silent)

    def pending(self) -> int:
        """Requests being tokenized."""
        return len(self.preparing)

    def forget(self, stream_id: str) -> None:
        """Stop caring about a stream being tokenized (it was handed back)."""
        if self.preparing.pop(stream_id, None) is not None:
            self.preparer.forget(stream_id)

    def close(self) -> None:
        """Drop the tokenizing (shutdown: the streams end with the others)."""
        self.preparer.close()
        self.preparing.clear()

    def reject(self, a: Active, code: ErrorCode, message: str) -> None:
        """End a stream that never ran: ``rejected`` with ``code``, then ``done error``."""
        self.counters["rejected"] += 1
        a.events += [rejected_fields(code, message), done_fields(FinishReason.ERROR, 0, 0, message)]
        a.final = True
        extra = {"stream_id": a.stream_id, "request_id": a.request_id, "code": code}
        log.info("request rejected: %s", message, extra=extra)

    def end(self, a: Active, reason: FinishReason, message: str | None = None) -> None:
        """End a stream now (its engine request is already aborted or gone)."""
        if a.final or a.silent:
            return
        prompt = int(a.meta.get(M.PROMPT_TOKENS, 0) or 0)
        a.events.append(done_fields(reason, prompt, a.completion_events, message))
        a.final = True
        self.counters[reason] = self.counters.get(reason, 0) + 1

    def _cancelled_before_start(self, a: Active) -> None:
        a.events.append(rejected_fields(FinishReason.CANCELLED, "cancelled before it started"))
        a.events.append(done_fields(FinishReason.CANCELLED, 0, 0))
        a.final = True
        self.counters[FinishReason.CANCELLED] += 1

    def _add(
        self, a: Active, prepared: Prepared, params: SamplingParams, meta: dict[str, str]
    ) -> None:
        extra = {"stream_id": a.stream_id, "request_id": a.request_id}
        going_on = a.continued
        if going_on is not None and len(going_on) >= params.max_tokens:  # all but the done
            n = len(prepared.token_ids or [])
            a.read_calls(params.offered_tools, getattr(self.engine, "tool_format", None))
            a.events += a.finish_events(FinishReason.LENGTH, n, len(going_on), None)
            a.final = True
            return
        try:
            if prepared.error is not None:
                raise prepared.error
            ids = prepared.token_ids or []
            n = self.engine.add_request(
                a.stream_id, ids, params, generated=going_on or (), guide=prepared.guide
            )
        except EngineRefused as exc:
            self._refuse(a, exc.code, exc.message)
            return
        except (ValueError, TypeError) as exc:
            self._refuse(a, ErrorCode.BAD_REQUEST, str(exc))
            return
        except Exception as exc:
            log.exception("request could not be added", extra=extra)
            self._refuse(a, ErrorCode.INTERNAL, f"could not start: {exc.__class__.__name__}")
            return
        a.in_engine = True
        a.read_calls(params.offered_tools, getattr(self.engine, "tool_format", None))
        self.telemetry.admitted(a.stream_id, meta, a.traceparent)
        if going_on is not None:  # seq 0 and the tokens so far are in the log already
            a.meta[M.PROMPT_TOKENS] = str(n)
            log.info("request continued", extra={**extra, "prompt_tokens": n,
                                                 "generated": len(going_on)})  # fmt: skip
            return
        a.events.append(accepted_fields(n, self.worker_id))
        a.meta.update(
            {M.STATUS: StreamStatus.RUNNING, M.WORKER: self.worker_id, M.PROMPT_TOKENS: str(n)}
        )
        log.info("request started", extra={**extra, "prompt_tokens": n})

    def _refuse(self, a: Active, code: ErrorCode, message: str) -> None:
        """A request the engine would not take: ``rejected`` at seq 0, or, for a stream
        being continued (its seq 0 is written), ``done error``."""
        if a.continued is None:
            self.reject(a, code, message)
        else:
            self.end(a, FinishReason.ERROR, f"could not continue: {message}")
