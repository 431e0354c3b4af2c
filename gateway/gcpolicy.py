"""The gateway process's garbage-collector policy: what exists at startup is frozen.

CPython's cyclic collector pauses the event loop, and a full collection
traverses every tracked object. A gateway holds two kinds: what imports and
startup built (modules, functions, classes, the app: about 50,000 objects) and
what its connections hold (about 170 per WebSocket). The first kind never
becomes garbage, so it is moved out of the collector's sight once the server
is up (:func:`gc.freeze`): every later full collection (they come with bursts of
connects and disconnects) has that much less to walk. Reference counting still
frees everything as usual. ``TOKENRELAY_GC_FREEZE=0`` leaves the collector as
it is.
"""

from __future__ import annotations

import gc
import logging
import time

from tokenrelay.core.runtime import env_switch

log = logging.getLogger("tokenrelay.server")

ENV_SWITCH = "TOKENRELAY_GC_FREEZE"


def freeze_startup_heap() -> int:
    """Collect once, then freeze every surviving object; returns how many are frozen (0: off)."""
    if not env_switch(ENV_SWITCH):
        return 0
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info(
        "startup heap frozen out of the cyclic GC",
        extra={"objects": frozen, "ms": round((time.perf_counter() - started) * 1000, 1)},
    )
    return frozen
