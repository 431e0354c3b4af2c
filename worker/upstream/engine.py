"""The relay's engine: an :class:`worker.engine_client.EngineClient` whose requests are HTTP calls.

:class:`UpstreamEngine` is what ``tokenrelay worker --upstream URL`` drives in
place of our engine, with the same worker loop (worker/main.py): the same
consumer group, stream log, cancels, detach timeout, drain and heartbeat. Its
calls (worker/upstream/call.py) run as tasks of one asyncio loop in a thread of
its own (uvloop's where installed, as the gateway's: ``TOKENRELAY_EVENT_LOOP``), over
one pooled :class:`worker.upstream.client.HttpClient` (keep-alive connections, at most
``--max-inflight`` + a few), so many streams share a handful of threads and the
worker loop never blocks on the network.

It has no tokenizer (:class:`worker.engine_client.TakesBody`): Intake hands it each
request body through :meth:`UpstreamEngine.starter`; a call opens with its first
token (only then is the stream ``accepted``: failures before it can still be
retried, or refuse the stream with ``unavailable``), the worker attaches it
(``add_request``), and :meth:`UpstreamEngine.step` returns the text that arrived
since the last step, waiting up to :data:`STEP_WAIT` when none has.
:meth:`UpstreamEngine.abort` cancels the call's task, which closes its connection.

Why a client of our own rather than httpx (the first one) or aiohttp: per streamed
token their layers cost several times what the rest of the relay does
(worker/upstream/client.py says what it keeps of httpx's behaviour: timeouts per
read, a response closed early closes its connection, a bounded pool).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.tools import Tool
from tokenrelay.worker.engine_client import Starter
from tokenrelay.worker.errors import TransportError, UpstreamError
from tokenrelay.worker.prepare import Prepared
from tokenrelay.worker.upstream.call import Call, Upstream
from tokenrelay.worker.upstream.client import HttpClient
from tokenrelay.worker.upstream.config import UpstreamConfig, redact
from tokenrelay.worker.upstream.inbox import ATTACHED, OPEN, OPENING, Inbox, Output

log = logging.getLogger("tokenrelay.upstream")

LIST_RETRY = 5.0  # seconds between asks for the upstream's model list, until it answers
STEP_WAIT = 0.02  # seconds a step waits for text when none has arrived
POOL_SPARE = 8  # connections beyond --max-inflight (model list, cancels)
CLOSE_WAIT = 3.0  # seconds the cancels of a closing relay may take
NO_TOKENIZER = "an upstream relay has no tokenizer: it takes request bodies (TakesBody)"


class UpstreamEngine:
    """Calls to one upstream server, stepped by the worker loop (one thread) like an engine."""

    backend = "upstream"  # in the worker's stats (core/wire/stats.py)

    def __init__(self, cfg: UpstreamConfig, *, step_wait: float = STEP_WAIT) -> None:
        self.cfg = cfg
        self.step_wait = step_wait
        self.inbox = Inbox()
        self._tasks: dict[str, concurrent.futures.Future[None]] = {}
        self._lock = threading.Lock()  # _tasks: the loop's done callbacks and the worker
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="upstream", daemon=True)
        self._thread.start()
        self.up: Upstream = self._run(self._open())
        self._starter = _Starter(self)
        self._learning: concurrent.futures.Future[None] | None = None
        if cfg.announced(None) is None:  # the names clients use are the upstream's
            self._run(self._learn_models(once=True))
            if self.up.listed is None:
                learn = self._learn_models(once=False)
                self._learning = asyncio.run_coroutine_threadsafe(learn, self._loop)
        log.info("upstream relay", extra={"upstream": redact(cfg.url), "model": cfg.model,
                                          "max_inflight": cfg.max_inflight})  # fmt: skip

    async def _open(self) -> Upstream:
        cfg = self.cfg
        http = HttpClient(cfg.url, timeout=cfg.timeout, connect_timeout=cfg.connect_timeout,
                          max_connections=cfg.max_inflight + POOL_SPARE)  # fmt: skip
        return Upstream(http, cfg, self.inbox, cfg.model, cfg.model is not None)

    async def _learn_models(self, *, once: bool) -> None:
        """Ask the upstream for its model list (``once``, or until it gives one)."""
        while True:
            try:
                await self.up.list_models()
            except (UpstreamError, TransportError) as exc:
                log.info("the upstream's model list is not known yet: %s", exc)
            if once or self.up.listed is not None:
                return
            await asyncio.sleep(LIST_RETRY)

    def served_models(self) -> list[str] | None:
        """The model names clients use for this relay, which its worker announces and
        reads the request queues of; ``None`` while the upstream has not listed its models
        (the worker then serves the requests that name no model)."""
        return self.cfg.announced(self.up.listed)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # --- TakesBody ----------------------------------------------------------------------

    def starter(self) -> Starter:
        return self._starter

    def start(self, stream_id: str, body: dict[str, Any]) -> None:
        """Start the call of one request body (its outcome comes from the starter's take)."""
        if not self.inbox.add(stream_id):
            return
        call = Call(self.up, stream_id, body)
        future = asyncio.run_coroutine_threadsafe(call.run(), self._loop)
        with self._lock:
            self._tasks[stream_id] = future
        future.add_done_callback(functools.partial(self._done, stream_id))

    def _done(self, stream_id: str, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            if self._tasks.get(stream_id) is future:
                del self._tasks[stream_id]

    def _cancel(self, stream_id: str) -> None:
        with self._lock:
            future = self._tasks.pop(stream_id, None)
        if future is not None:
            future.cancel()  # cancels the task on the loop: its connection closes

    # --- EngineClient -------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        raise ValueError(NO_TOKENIZER)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: tuple[Tool, ...] = ()
    ) -> list[int]:
        raise ValueError(NO_TOKENIZER)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        generated: Sequence[int] = (),
        guide: Any = None,
    ) -> int:
        """Attach an opened call (the body went in through the starter); its prompt tokens
        when the upstream has said (else 0). ``ValueError`` for a call not opened, or for
        ``generated`` tokens (an upstream cannot continue another's answer). No ``guide``:
        the upstream enforces a ``response_format`` itself."""
        if generated:
            raise ValueError("a relayed answer cannot be continued from another worker's log")
        return self.inbox.attach(request_id)

    def abort(self, request_id: str) -> bool:
        found = self.inbox.abort(request_id)
        self._cancel(request_id)
        return found

    def has_unfinished(self) -> bool:
        return self.inbox.has_attached()

    def unstarted_requests(self) -> list[str]:
        return []  # a call is attached only once its first token is in

    def step(self) -> list[Output]:
        return self.inbox.drain(self.step_wait)

    def stats(self) -> Mapping[str, Any]:
        phases = self.inbox.counts()
        counters = self.up.counters.copy()  # (written on the loop's thread)
        return {
            "max_num_seqs": self.cfg.max_inflight,
            "running": phases[ATTACHED],
            "waiting": phases[OPENING] + phases[OPEN],
            "generated_tokens": counters.pop("upstream_chunks", 0),
            **counters,
        }

    def close(self) -> None:
        """Cancel every call, let their cancels reach a tokenrelay upstream (a few seconds
        at most), close the connections and stop the thread (the worker is ending)."""
        with self._lock:
            futures = list(self._tasks.values())
            self._tasks.clear()
        if self._learning is not None:
            futures.append(self._learning)
        for future in futures:
            future.cancel()
        with contextlib.suppress(Exception):
            self._run(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _close(self) -> None:
        await asyncio.sleep(0)  # the cancelled calls close their responses, post their cancels
        if self.up.background:
            await asyncio.wait(list(self.up.background), timeout=CLOSE_WAIT)
        await self.up.http.aclose()


class _Starter:
    """The engine's :class:`worker.engine_client.Starter`: calls not yet attached."""

    def __init__(self, engine: UpstreamEngine) -> None:
        self.engine = engine

    def submit(self, stream_id: str, body: dict[str, Any]) -> None:
        self.engine.start(stream_id, body)

    def take(self) -> list[Prepared]:
        return self.engine.inbox.take_opened()

    def forget(self, stream_id: str) -> None:
        """Stop a call that was not attached (cancelled, handed back); an attached one
        is the loop's to abort."""
        if self.engine.inbox.phase(stream_id) != ATTACHED:
            self.engine.abort(stream_id)

    def pending(self) -> int:
        phases = self.engine.inbox.counts()
        return phases[OPENING] + phases[OPEN]

    def wait(self, timeout: float) -> bool:
        return self.engine.inbox.wait_opened(timeout)

    def close(self) -> None:
        inbox = self.engine.inbox
        for sid in [s for s, phase in inbox.phases().items() if phase != ATTACHED]:
            self.engine.abort(sid)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The calls' event loop: uvloop's where installed (cheaper reads, writes and timers),
    else asyncio's; ``TOKENRELAY_EVENT_LOOP=asyncio`` forces the standard one."""
    if os.environ.get("TOKENRELAY_EVENT_LOOP", "auto") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def upstream_engine(args: argparse.Namespace) -> UpstreamEngine:
    """The relay engine of ``tokenrelay worker --upstream URL``'s options."""
    return UpstreamEngine(UpstreamConfig.from_args(args))
