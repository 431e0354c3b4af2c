"""gateway/gcpolicy.py: the startup heap is frozen out of the cyclic GC (in a child process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.root import ROOT

PROBE = """
import gc, json
import tokenrelay.gateway.app  # what a gateway process imports before it serves
from tokenrelay.gateway.gcpolicy import freeze_startup_heap
cycle = []
cycle.append(cycle)  # garbage made before the freeze is collected, not frozen
del cycle
frozen = freeze_startup_heap()
print(json.dumps({"frozen": frozen, "count": gc.get_freeze_count(), "enabled": gc.isenabled()}))
"""


def probe(**env: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_startup_objects_are_frozen_and_collection_stays_on() -> None:
    got = probe()
    assert isinstance(got["frozen"], int) and got["frozen"] > 10_000  # modules, classes, the app
    assert got["count"] == got["frozen"]
    assert got["enabled"] is True  # only the startup heap leaves the collector's sight


def test_env_switch_turns_it_off() -> None:
    got = probe(TOKENRELAY_GC_FREEZE="0")
    assert got == {"frozen": 0, "count": 0, "enabled": True}
