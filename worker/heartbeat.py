"""The worker's heartbeat: its stats in Redis every second, in a thread of its own.

A beat publishes the worker's stats snapshot (``WorkerStore.heartbeat``); gateways read
it to know the worker is alive and how busy it is. The loop in :mod:`tokenrelay.worker.main` takes
the snapshot when the heartbeat asks for one.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from tokenrelay.core.redis.connection import RedisHealth, is_outage
from tokenrelay.core.wire.keys import HEARTBEAT_INTERVAL
from tokenrelay.worker.store import WorkerStore

if TYPE_CHECKING:
    from tokenrelay.worker.main import Worker

log = logging.getLogger("tokenrelay.worker")

STATS_WAIT = 0.5  # seconds a heartbeat waits for the loop to refresh the stats snapshot


class Heartbeat(threading.Thread):
    """Publishes the worker's stats snapshot every second.

    Each beat asks the worker's loop for a snapshot taken at the end of its current
    iteration and waits for it at most :data:`STATS_WAIT` (a long step delays no more).
    """

    def __init__(self, worker: Worker, url: str, prefix: str, *, cluster: bool = False) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.worker = worker
        self.store = WorkerStore(url, worker.worker_id, prefix=prefix, cluster=cluster)
        self.health = RedisHealth("heartbeat")

    def run(self) -> None:
        snapshot, waited = self.worker.snapshot, 0.0  # the first beat's: taken just before
        while not self.worker.stopping.is_set():
            try:
                self.store.heartbeat(snapshot)
                self.health.ok()
            except Exception as exc:
                if not is_outage(exc):
                    log.exception("heartbeat failed")
                self.health.failed(exc)
            if self.worker.stopping.wait(HEARTBEAT_INTERVAL - waited):  # the same beat
                break
            asked = time.monotonic()
            snapshot = self.worker.fresh_snapshot(STATS_WAIT)
            waited = time.monotonic() - asked
