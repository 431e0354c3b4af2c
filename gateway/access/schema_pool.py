"""llguidance's schema checks off the event loop: a few threads and a bounded queue.

Validating a request is sans I/O and runs on the event loop (core/wire/requests.py),
except its last schema check, llguidance's verdict on each JSON schema of ``tools`` and
``response_format``: that can take seconds, and on the loop it would stall every stream
and ``/healthz`` of the gateway meanwhile. :meth:`SchemaPool.parse` runs a transport's
parser with those verdicts deferred (core/wire/schema_verdicts.py), then computes the
ones not cached yet on its threads and awaits them:

* each distinct schema is checked once: a verdict is cached for the process, and a
  request whose schema is being checked for another waits for that check;
* at most ``threads`` checks run at once; the requests whose checks are under way are
  at most ``threads`` + ``queue``, and one more is refused at once with ``overloaded``
  (retry shortly): never queued without bound, never checked on the loop;
* a refused schema is ``bad_request`` naming its field, as the inline check said it.

The request's schemas together are bounded before any of this
(core/wire/schema_budget.py), so one check is bounded too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tokenrelay.core.wire.errors import RequestError
from tokenrelay.core.wire.schema_verdicts import PendingVerdict, compute_verdict, deferred_verdicts
from tokenrelay.core.wire.vocabulary import ErrorCode

__all__ = ["BUSY", "DEFAULT_QUEUE", "DEFAULT_THREADS", "SCHEMAS", "SchemaPool"]

T = TypeVar("T")
DEFAULT_THREADS = 2  # schema checks at once (llguidance releases the GIL while it checks)
DEFAULT_QUEUE = 32  # more requests whose checks wait for a thread; beyond them: overloaded
BUSY = "too many JSON schemas are being checked; retry shortly"


class SchemaPool:
    """The gateway's schema checks: ``threads`` threads, ``queue`` more requests waiting."""

    def __init__(self, threads: int = DEFAULT_THREADS, queue: int = DEFAULT_QUEUE) -> None:
        """Raises ``ValueError`` for ``threads`` < 1 or ``queue`` < 0."""
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"schema check threads must be an integer >= 1, got {threads!r}")
        if isinstance(queue, bool) or not isinstance(queue, int) or queue < 0:
            raise ValueError(f"schema check queue must be an integer >= 0, got {queue!r}")
        self.threads = threads
        self.queue = queue
        self._executor: ThreadPoolExecutor | None = None  # started by the first check
        self._running: dict[str, asyncio.Future[str]] = {}  # schema key -> its check
        self.waiting = 0  # requests whose checks are under way
        self.checked = 0  # checks run on the threads
        self.refused = 0  # requests refused as overloaded

    async def parse(
        self, parse: Callable[[], T], refuse: Callable[[T, RequestError], Exception]
    ) -> T:
        """``parse()`` (a transport's validator, run here, on the loop) with the verdicts on
        its schemas computed on the pool's threads; what it returned, once all pass.

        A schema refused, or a pool too busy for the request's checks, raises what
        ``refuse(result, error)`` gives for the :class:`RequestError` (``bad_request``
        naming the schema's field, or ``overloaded``); what ``parse`` raises goes through.
        """
        with deferred_verdicts() as pending:
            result = parse()
        if pending:
            try:
                await self.check(pending)
            except RequestError as exc:
                raise refuse(result, exc) from None
        return result

    async def check(self, pending: Sequence[PendingVerdict]) -> None:
        """Compute (or join the running checks of) the verdicts of ``pending``; raises
        :class:`RequestError` for the first refused one, in order, or for a full pool."""
        if self.waiting >= self.threads + self.queue:
            self.refused += 1
            raise RequestError(ErrorCode.OVERLOADED, BUSY, pending[0].field)
        loop = asyncio.get_running_loop()
        for v in pending:
            if v.key not in self._running:
                self._start(loop, v)
        # shielded: a request that goes away (its client left) leaves the check to the others
        checks = [asyncio.shield(self._running[v.key]) for v in pending]
        self.waiting += 1
        try:
            verdicts = await asyncio.gather(*checks)
        finally:
            self.waiting -= 1
        for v, error in zip(pending, verdicts, strict=True):
            if error:
                raise RequestError(ErrorCode.BAD_REQUEST, f"{v.field}: {error}", v.field)

    def _start(self, loop: asyncio.AbstractEventLoop, v: PendingVerdict) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="schema-check")
        self.checked += 1
        future = loop.run_in_executor(self._executor, compute_verdict, v.key, v.text)
        self._running[v.key] = future
        future.add_done_callback(lambda _: self._running.pop(v.key, None))

    def close(self) -> None:
        """Stop the threads after the checks they are on; waiting checks are dropped."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


SCHEMAS = SchemaPool()  # the process's: its gateway's HTTP, WebSocket and gRPC requests
