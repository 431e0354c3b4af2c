"""worker/settings.py: the worker's options, typed and checked once."""

from __future__ import annotations

import argparse

import pytest

from tokenrelay.core.cli import build_parser
from tokenrelay.worker.settings import WorkerSettings


def _parsed(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["worker", *argv])


def test_the_worker_command_line_becomes_settings() -> None:
    argv = ["--redis-url", "redis://h:1", "--redis-prefix", "x:", "--detach-timeout", "5"]
    s = WorkerSettings.from_args(_parsed(*argv, "--health-port", "9100"))
    assert (s.redis_url, s.redis_prefix, s.detach_timeout, s.health_port) == (
        "redis://h:1", "x:", 5.0, 9100,
    )  # fmt: skip
    assert s.upstream is None and s.worker_id  # a made-up id: host-pid-random
    assert (
        WorkerSettings.from_args(_parsed("--redis-url", "r://", "--worker-id", "w1")).worker_id
        == "w1"
    )


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--detach-timeout", "-1"], "--detach-timeout"),
        (["--stream-ttl", "0"], "--stream-ttl"),
        (["--drain-timeout", "-2"], "--drain-timeout"),
        (["--health-port", "70000"], "--health-port"),
        (["--otlp-endpoint", "ftp://x"], "--otlp-endpoint"),
    ],
)
def test_a_bad_value_names_its_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        WorkerSettings.from_args(_parsed("--redis-url", "redis://h:1", *argv))


def test_no_redis_url_is_refused() -> None:
    with pytest.raises(ValueError, match="--redis-url"):
        WorkerSettings.from_args(argparse.Namespace(redis_url=None))
