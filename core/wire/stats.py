"""The stats snapshot a worker publishes in its heartbeat, as one typed schema.

A worker writes it (``worker/main.py``) into the ``stats`` field of its
heartbeat hash ``P w:<worker_id>`` (core/wire/keys.py) every second; gateways
read it for ``/metrics`` and ``/readyz``. On the wire it is one flat JSON
object (the engine's counters, the worker's :data:`COUNTERS`, ``active_streams``,
``worker_id``, ``draining``, the latency histograms under ``hist``, the ``backend``
and the ``models`` the worker serves), so a reader of another version still finds
the numbers it knows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tokenrelay.core.wire.events import FINISH_REASONS
from tokenrelay.core.wire.keys import MAX_MODEL_NAME

# The worker's own counters: requests taken, requests rejected, streams ended per reason.
COUNTERS = ("requests", "rejected", "continued", *FINISH_REASONS)  # continued: taken over

STATS_FIELD = "stats"  # the heartbeat hash's field that holds the snapshot

BACKENDS = ("engine", "upstream")  # our engine, or a relay to an OpenAI-compatible server
MAX_MODELS = 64  # model names one worker may announce
_NOT_NUMBERS = ("worker_id", "draining", "hist", "active_streams", "backend", "models")

Number = int | float


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class WorkerStats:
    """One worker's published figures.

    ``engine``: the engine's counters (``blocks_total``, ``blocks_free``,
    ``running``, ``waiting``, ``generated_tokens`` ...); ``counters``: the
    worker's :data:`COUNTERS`; ``hist``: the latency histograms as
    :meth:`core.wire.telemetry.Hist.to_json` gives them, by name; ``backend``: one of
    :data:`BACKENDS`; ``models``: the names of the models whose request queues the
    worker reads (core/wire/keys.py ``Keys.queue``), empty for a worker that names none.
    """

    worker_id: str = ""
    draining: bool = False
    active_streams: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    engine: dict[str, Number] = field(default_factory=dict)
    hist: dict[str, Any] = field(default_factory=dict)
    backend: str = "engine"
    models: list[str] = field(default_factory=list)

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
            backend=self.backend,
            models=self.models,
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
        backend = flat.get("backend")
        out.backend = backend if backend in BACKENDS else "engine"
        out.models = model_names(flat.get("models"))
        active = flat.get("active_streams")
        out.active_streams = int(active) if isinstance(active, int | float) else 0
        for key, value in flat.items():
            if key in _NOT_NUMBERS or not _is_number(value):
                continue
            if key in COUNTERS:
                out.counters[key] = int(value)
            else:
                out.engine[key] = value
        return out


def model_names(raw: object) -> list[str]:
    """The announced model names in ``raw`` (a published ``models`` list): the strings of
    1 to :data:`~core.wire.keys.MAX_MODEL_NAME` characters, first :data:`MAX_MODELS`,
    each once; anything else is skipped."""
    if not isinstance(raw, list):
        return []
    out: list[str] = []
    for name in raw:
        if isinstance(name, str) and 0 < len(name) <= MAX_MODEL_NAME and name not in out:
            out.append(name)
    return out[:MAX_MODELS]


def checked_models(names: list[str], flag: str) -> list[str]:
    """``names`` as a worker announces them (each once, in order); ``ValueError`` naming
    ``flag`` for an empty one, one over :data:`~core.wire.keys.MAX_MODEL_NAME`
    characters or with control characters, or over :data:`MAX_MODELS` names."""
    out: list[str] = []
    for name in names:
        if not name or len(name) > MAX_MODEL_NAME or not name.isprintable():
            shown = name[:40] + ("..." if len(name) > 40 else "")
            raise ValueError(
                f"{flag}: a model name is 1 to {MAX_MODEL_NAME} printable characters, got {shown!r}"
            )
        if name not in out:
            out.append(name)
    if len(out) > MAX_MODELS:
        raise ValueError(f"{flag}: at most {MAX_MODELS} model names, got {len(out)}")
    return out
