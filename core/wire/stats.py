"""The stats snapshot a worker publishes in its heartbeat, as one typed schema.

A worker writes it (``worker/main.py``) into the ``stats`` field of its
heartbeat hash ``P w:{worker_id}`` (core/wire/keys.py) every second; gateways
read it for ``/metrics`` and ``/readyz``. On the wire it is one flat JSON
object (the engine's counters, the worker's :data:`COUNTERS`, ``active_streams``,
``worker_id``, ``draining`` and the latency histograms under ``hist``), so a
reader of another version still finds the numbers it knows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from core.wire.events import FINISH_REASONS

# The worker's own counters: requests taken, requests rejected, streams ended per reason.
COUNTERS = ("requests", "rejected", *FINISH_REASONS)

STATS_FIELD = "stats"  # the heartbeat hash's field that holds the snapshot

Number = int | float


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class WorkerStats:
    """One worker's published figures.

    ``engine``: the engine's counters (``blocks_total``, ``blocks_free``,
    ``running``, ``waiting``, ``generated_tokens`` ...); ``counters``: the
    worker's :data:`COUNTERS`; ``hist``: the latency histograms as
    :meth:`core.wire.telemetry.Hist.to_json` gives them, by name.
    """

    worker_id: str = ""
    draining: bool = False
    active_streams: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    engine: dict[str, Number] = field(default_factory=dict)
    hist: dict[str, Any] = field(default_factory=dict)

    def number(self, key: str) -> float | None:
        """The figure ``key`` (an engine counter, a finish reason, ``active_streams``)."""
        if key == "active_streams":
            return float(self.active_streams)
        if key in self.counters:
            return float(self.counters[key])
        value = self.engine.get(key)
        return float(value) if value is not None else None

    def to_json(self) -> str:
        """The flat JSON object that goes into the heartbeat hash."""
        flat: dict[str, Any] = {**self.engine, **self.counters}
        flat.update(
            active_streams=self.active_streams,
            worker_id=self.worker_id,
            draining=self.draining,
            hist=self.hist,
        )
        return json.dumps(flat, default=str)

    @classmethod
    def from_json(cls, raw: object) -> WorkerStats | None:
        """Decode a published snapshot; ``None`` for anything that is not one."""
        if not isinstance(raw, bytes | str):
            return None
        try:
            flat = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(flat, dict):
            return None
        out = cls(
            worker_id=str(flat.get("worker_id", "")),
            draining=flat.get("draining") is True,
            hist=flat["hist"] if isinstance(flat.get("hist"), dict) else {},
        )
        active = flat.get("active_streams")
        out.active_streams = int(active) if isinstance(active, int | float) else 0
        for key, value in flat.items():
            if key in ("worker_id", "draining", "hist", "active_streams") or not _is_number(value):
                continue
            if key in COUNTERS:
                out.counters[key] = int(value)
            else:
                out.engine[key] = value
        return out
