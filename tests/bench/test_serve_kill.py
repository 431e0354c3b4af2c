"""bench/serve_kill.py's pure parts: the timeline read from serve's JSON log, the pause."""

from __future__ import annotations

import json

from bench.serve_kill import log_events, longest_pause


def line(ts: float, msg: str, **extra: object) -> str:
    return json.dumps({"ts": ts, "level": "info", "logger": "x", "msg": msg, **extra})


def test_log_events_after_the_kill_in_seconds() -> None:
    text = "\n".join([
        line(100.0, "engine worker started", pid=1),  # serve's first worker: before the kill
        line(101.0, "loading model"),
        "a library printing on its own",
        line(110.2, "engine worker exited; restarting", pid=1),
        line(111.3, "engine worker started", pid=2),
        line(112.0, "loading model", worker="h-2-ab"),
        line(115.5, "worker ready", worker="h-2-ab"),
        line(115.9, "request continued", stream_id="s1"),
        line(116.0, "request continued", stream_id="s2"),
        line(116.1, "request started"),
        "[1, 2]",
    ])  # fmt: skip
    assert log_events(text, 110.0) == {
        "exit": [0.2],
        "spawned": [1.3],
        "loading": [2.0],
        "ready": [5.5],
        "continued": [5.9, 6.0],
    }


def test_longest_pause() -> None:
    assert longest_pause([]) == longest_pause([3.0]) == 0.0
    assert longest_pause([1.0, 1.5, 4.5, 4.75]) == 3.0
