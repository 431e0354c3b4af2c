"""``tokenrelay worker``: the engine loop, fed from and streaming to Redis.

One worker process drives one engine (worker/engine_client.py: ours, or a relay with
``--upstream``). Its loop takes requests from the consumer group, applies cancels and
detach timeouts, runs one engine step and appends every stream's new events in one
pipelined round trip (worker/store.py), keeping them until Redis confirmed them: a
Redis restart loses nothing. A heartbeat thread publishes the engine's stats.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
import time

from tokenrelay.core.redis.connection import Backoff, RedisHealth, check_cluster_mode, is_outage
from tokenrelay.core.wire.keys import CLAIM_INTERVAL
from tokenrelay.core.wire.stats import COUNTERS, WorkerStats
from tokenrelay.core.wire.vocabulary import FinishReason
from tokenrelay.worker.engine_client import (
    EngineClient,
    StepOutput,
    TakesBody,
    engine_config,
    local_engine,
    served_models,
)
from tokenrelay.worker.health import start_health
from tokenrelay.worker.heartbeat import Heartbeat
from tokenrelay.worker.intake import Intake
from tokenrelay.worker.lifecycle import StatusPipe, die_with_serve, install_signals
from tokenrelay.worker.outbox import Outbox, hand_back
from tokenrelay.worker.settings import WorkerSettings
from tokenrelay.worker.store import WorkerStore
from tokenrelay.worker.telemetry import WorkerTelemetry

log = logging.getLogger("tokenrelay.worker")

POLL_INTERVAL = 0.5  # seconds between attachment / cancel-flag checks
OWN_PENDING_INTERVAL = 5.0  # seconds between looks for requests taken before an outage
IDLE_BLOCK_MS = 200
STATS_MAX_AGE = 0.5  # seconds: the loop refreshes an older snapshot even unasked
MAX_STEP_FAILURES = 3


class Worker:
    """Runs one engine against the stream log until :meth:`stop`."""

    def __init__(
        self, engine: EngineClient, store: WorkerStore, *, detach_timeout: float, stream_ttl: float
    ) -> None:
        self.engine = engine
        self.store = store
        self.worker_id = store.worker_id
        self.detach_timeout = detach_timeout
        self.stream_ttl = stream_ttl
        self.max_seqs = int(engine.stats().get("max_num_seqs", 64))
        # token ids go in the log where another worker could continue from them (our
        # engine; a relay's upstream cannot be resumed mid-answer)
        self.records_ids = not isinstance(engine, TakesBody)
        self.outbox = Outbox(store, engine.abort)
        self.active = self.outbox.streams  # stream id -> Active
        self.health = RedisHealth("worker")
        self.stopping = threading.Event()
        self.draining = threading.Event()  # SIGTERM: finish what runs, take nothing new
        self.drain_deadline = 0.0
        self._handed_back = False
        self.telemetry = WorkerTelemetry(store, self.worker_id, engine.backend)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.intake = Intake(
            engine,
            store,
            self.active,
            self.counters,
            self.telemetry,
            detach_timeout=detach_timeout,
            stream_ttl=stream_ttl,
        )
        self.snapshot = WorkerStats(worker_id=self.worker_id)
        self._stats_at = 0.0  # when the snapshot was taken (monotonic)
        self._stats_wanted = threading.Event()  # the heartbeat asks for a fresh snapshot
        self._stats_taken = threading.Event()  # ... and the loop says it has taken one
        self._last_poll = self._last_claim = self._last_own = 0.0
        self._step_failures = 0
        self._last_error_log = 0.0

    # --- loop ------------------------------------------------------------------------

    def run(self) -> None:
        backoff = Backoff(0.05, 1.0)
        started = False
        while not self.stopping.is_set():
            try:
                if not started:
                    self.store.ensure_group()
                    self.intake.admit_all(self.store.read_own_pending())
                    started = True
                self._iteration()
                self.health.ok()
                backoff.reset()
                if self.draining.is_set():
                    if self._drained():
                        break
                    if not self.engine.has_unfinished():
                        self.stopping.wait(0.05)  # waiting on Redis writes: don't spin
            except Exception as exc:
                if is_outage(exc):
                    self.health.failed(exc)
                elif time.monotonic() - self._last_error_log >= 10:
                    self._last_error_log = time.monotonic()
                    log.exception("worker loop error (continuing)")
                self.stopping.wait(backoff.next())
                if self.draining.is_set() and time.monotonic() >= self.drain_deadline:
                    break
        self.stopping.set()  # the heartbeat thread stops too
        self._stats_taken.set()  # (not waiting for a snapshot first)
        self._shutdown()

    def stop(self) -> None:
        """Stop now: streams still running end with ``error``."""
        self.stopping.set()

    def drain(self, timeout: float) -> None:
        """Stop taking requests, finish the running ones within ``timeout`` seconds, then stop.

        Safe to call from a signal handler (it only sets flags). Requests that
        have not produced a token yet are handed back to the queue for another
        worker; streams still running at the deadline end with ``error``.
        """
        if not self.draining.is_set():
            self.drain_deadline = time.monotonic() + max(0.0, timeout)
            self.draining.set()

    def _drained(self) -> bool:
        if not self._handed_back:
            self._handed_back = True
            self._hand_back()
        return not self.active or time.monotonic() >= self.drain_deadline

    def _hand_back(self) -> None:
        """Give the unstarted requests back to the queue (their entries stay pending):
        the engine's, and those still being tokenized."""
        for sid in [*self.engine.unstarted_requests(), *self.intake.preparing]:
            a = self.active.get(sid)
            if a is not None and hand_back(a, self.store, self.engine.abort):
                self.telemetry.forget(sid)
                self.intake.forget(sid)

    def _iteration(self) -> None:
        if self.outbox.unwritten():
            self.outbox.flush()
            if self.outbox.blocked():  # Redis took only part: try again before more work
                return
        busy = self.engine.has_unfinished() or self.intake.pending() > 0
        room = 0 if self.draining.is_set() else self.max_seqs - len(self.active)
        if room > 0:
            if busy:  # with the cancel notices in one round trip (read_control below)
                reqs = self.store.read_new(room)
            else:
                reqs = self.store.read_requests(room, IDLE_BLOCK_MS)
            self.intake.admit_all(reqs)
        if self.intake.start_prepared():
            self.outbox.flush()  # clients get `started` before the first step
        for sid in self.store.read_control():
            self._abort(sid, FinishReason.CANCELLED)
        now = time.monotonic()
        if now - self._last_poll >= POLL_INTERVAL:
            self._last_poll = now
            self._poll(now)
        if now - self._last_claim >= CLAIM_INTERVAL and not self.draining.is_set():
            self._last_claim = now
            self.intake.admit_all(self.store.claim_dead())  # dead workers' streams go on here
        if now - self._last_own >= OWN_PENDING_INTERVAL and not self.draining.is_set():
            self._last_own = now
            # requests read just before an outage interrupted their admission
            self.intake.admit_all(self.store.read_own_pending())
        if self.engine.has_unfinished():
            self._step()
            self.outbox.flush()
        elif self.intake.pending():  # nothing to step: wait for the tokenizer
            self.intake.preparer.wait(IDLE_BLOCK_MS / 1000)
        self.telemetry.finished(self.outbox.take_finished())
        # only the heartbeat reads the snapshot: take it when asked (or grown old)
        if self._stats_wanted.is_set() or time.monotonic() - self._stats_at >= STATS_MAX_AGE:
            self._publish_stats()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._step_failures += 1
            log.exception("engine step failed")
            for broken in list(self.active.values()):
                if broken.in_engine and not broken.final:
                    self.engine.abort(broken.stream_id)
                    self.intake.end(
                        broken, FinishReason.ERROR, f"engine error: {exc.__class__.__name__}"
                    )
            if self._step_failures >= MAX_STEP_FAILURES:
                raise SystemExit(1) from exc
            return
        self._step_failures = 0
        for out in outputs:
            try:
                self._take(out)
            except Exception as exc:  # one stream's bug never drops the step's other outputs
                a = self.active.get(out.request_id)
                extra = {"stream_id": out.request_id, "request_id": a and a.request_id}
                log.exception("a step output could not be written", extra=extra)
                if a is not None and not a.final:
                    if a.in_engine:
                        self.engine.abort(a.stream_id)
                        a.in_engine = False
                    self.intake.end(a, FinishReason.ERROR, f"internal error: {type(exc).__name__}")

    def _take(self, out: StepOutput) -> None:
        """One request's output of a step: its token event, its done event when it ended."""
        a = self.active.get(out.request_id)
        if a is None:
            return
        if out.new_token_ids:
            self.telemetry.token(a.stream_id, getattr(out, "upstream_ttft", None))
        if out.finished:
            a.in_engine = False
        if a.silent or a.final:
            return
        if out.new_logprobs:
            a.pending_logprobs.extend(out.new_logprobs)
        if self.records_ids:
            a.pending_ids.extend(out.new_token_ids)
        relayed = getattr(out, "new_calls", None)  # a relay's tool-call deltas
        if out.new_text or relayed:
            a.events.append(a.token_event(out.new_text, with_ids=self.records_ids,
                                          relayed=relayed or ()))  # fmt: skip
        if out.finished:
            reason = FinishReason(out.finish_reason or FinishReason.STOP)
            if reason == FinishReason.CANCELLED:  # aborted: by a cancel, or expired
                reason = a.abort_reason or FinishReason.CANCELLED
            self.counters[reason] = self.counters.get(reason, 0) + 1
            message = getattr(out, "message", None)  # why, for an error (engine_client.py)
            a.events += a.finish_events(reason, out.prompt_tokens, out.completion_tokens, message,
                                        getattr(out, "tool_calls", ()))  # fmt: skip
            a.final = True

    # --- requests --------------------------------------------------------------------

    def _abort(self, sid: str, reason: FinishReason) -> None:
        a = self.active.get(sid)
        if a is None or a.final or a.silent or a.abort_reason is not None:
            return
        a.abort_reason = reason
        if a.in_engine:
            self.engine.abort(sid)
        extra = {"stream_id": sid, "request_id": a.request_id, "reason": reason}
        log.info("aborting stream", extra=extra)

    def _poll(self, now: float) -> None:
        keep = set(self.active) | {a.stream_id for a in self.outbox.finished}
        self.telemetry.prune(keep)
        live = [a for a in self.active.values() if a.in_engine and a.abort_reason is None]
        state = self.store.poll([a.stream_id for a in live])
        for a in live:
            attached, cancel = state.get(a.stream_id, (1, False))
            if cancel:
                self._abort(a.stream_id, FinishReason.CANCELLED)
            elif attached:
                a.detached_since = None
            elif a.detached_since is None:
                a.detached_since = now
            elif now - a.detached_since >= a.detach_timeout:
                self._abort(a.stream_id, FinishReason.EXPIRED)

    # --- stats and shutdown ------------------------------------------------------------

    def _publish_stats(self) -> None:
        self.store.follow(self.engine.served_models)  # a relay learns them
        self._stats_wanted.clear()
        engine = {k: v for k, v in self.engine.stats().items() if isinstance(v, int | float)}
        self.snapshot = WorkerStats(
            worker_id=self.worker_id,
            draining=self.draining.is_set(),
            active_streams=len(self.active),
            counters=dict(self.counters),
            engine=engine,
            hist=self.telemetry.snapshot(),
            backend=self.telemetry.backend,
            models=self.store.models,
        )
        self._stats_at = time.monotonic()
        self._stats_taken.set()

    def fresh_snapshot(self, timeout: float) -> WorkerStats:
        """The stats as the loop's current iteration ends (called by the heartbeat thread).

        Waits at most ``timeout``; a longer iteration (a long prefill, an outage) gives
        the last snapshot, at most :data:`STATS_MAX_AGE` older than that iteration.
        """
        self._stats_taken.clear()
        self._stats_wanted.set()
        self._stats_taken.wait(timeout)
        return self.snapshot

    def _shutdown(self) -> None:
        message = "engine worker shut down before the stream finished"
        if self.draining.is_set() and time.monotonic() >= self.drain_deadline:
            message += " (drain timeout)"
        self.intake.close()
        for a in list(self.active.values()):
            if a.in_engine:
                self.engine.abort(a.stream_id)
                a.in_engine = False  # no further step will report it
            self.intake.end(a, FinishReason.ERROR, message)
        with contextlib.suppress(Exception):
            self.outbox.flush()
        with contextlib.suppress(Exception):
            self.telemetry.finished(self.outbox.take_finished())
        with contextlib.suppress(Exception):
            self.store.unregister()


def check(args: argparse.Namespace) -> int:
    """``tokenrelay serve``'s check before it starts anything: the engine options and model.

    Raises ``ValueError`` with one clear line (``tokenrelay`` exits with status 2);
    loads and converts nothing.
    """
    if getattr(args, "upstream", None):  # a relay: no model to check, and no torch
        from tokenrelay.worker.upstream.config import UpstreamConfig

        UpstreamConfig.from_args(args)
        return 0
    engine_config(args)
    served_models(args)
    return 0


def main(args: argparse.Namespace) -> int:
    """Entry point of ``tokenrelay worker``."""
    die_with_serve()
    status = StatusPipe.from_env()
    try:
        return _run_worker(args, status)
    except Exception as exc:
        status.failed(exc)
        raise


def _run_worker(args: argparse.Namespace, status: StatusPipe) -> int:
    settings = WorkerSettings.from_args(args)  # ValueError: one line, exit 2
    check_cluster_mode(settings.redis_url, settings.redis_cluster)
    worker_id, stop, tracing = settings.worker_id, threading.Event(), None
    if settings.otlp_endpoint:  # else nothing of OpenTelemetry is imported
        from tokenrelay.core.tracing import WORKER_SERVICE, start_tracing

        tracing = start_tracing(settings.otlp_endpoint, WORKER_SERVICE, worker_id)
    health = start_health(settings)  # --health-port: 503 "loading" until attached
    engine: EngineClient
    if settings.upstream:  # a relay to an upstream server (worker/upstream/)
        from tokenrelay.worker.upstream.engine import upstream_engine

        engine = relay = upstream_engine(args)
        models = relay.served_models() or []
    else:
        models = served_models(args)
        log.info("loading model", extra={"model": args.model, "worker": worker_id})
        engine = local_engine(args)  # a signal while loading just ends the process

    s, cluster = settings, settings.redis_cluster
    store = WorkerStore(
        s.redis_url, worker_id, prefix=s.redis_prefix, models=models, cluster=cluster
    )
    worker = Worker(engine, store, detach_timeout=s.detach_timeout, stream_ttl=s.stream_ttl)
    worker.stopping, worker.telemetry.tracing = stop, tracing
    install_signals(lambda: worker.drain(s.drain_timeout), stop.set, worker.draining.is_set)
    worker._publish_stats()
    if health is not None:
        health.attach(worker)  # its loop runs in this thread
    Heartbeat(worker, settings.redis_url, settings.redis_prefix, cluster=cluster).start()
    log.info("worker ready", extra={"worker": worker_id, **engine.stats()})
    status.ready()
    worker.run()
    if worker.telemetry.tracing is not None:
        worker.telemetry.tracing.shutdown()  # exports the spans still held
    engine.close()  # a relay's calls and connections, tensor-parallel ranks
    log.info("worker stopped", extra={"worker": worker_id, "drained": worker.draining.is_set()})
    return 0


if __name__ == "__main__":
    from tokenrelay.core.cli import main as cli_main

    sys.exit(cli_main(["worker", *sys.argv[1:]]))
