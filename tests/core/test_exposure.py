"""A gateway beyond loopback without API keys refuses to start unless told out loud."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gateway.procs import free_port
from tokenrelay.core.cli import build_parser
from tokenrelay.core.exposure import exposure_error, insecure_banner, is_loopback
from tokenrelay.core.redis.embedded import EmbeddedRedis


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.8.0.2", True), ("::1", True), ("[::1]", True),
     ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.1.2.3", False),
     ("example.org", False)],
)  # fmt: skip
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("command", ["gateway", "serve"])
def test_the_choice_is_made_out_loud(command: str) -> None:
    def parse(*flags: str) -> object:
        return build_parser().parse_args([command, "--redis-url", "redis://x:1/0", *flags])

    error = exposure_error(parse("--host", "0.0.0.0"))  # type: ignore[arg-type]
    assert error is not None and "--insecure-no-auth" in error and "0.0.0.0" in error
    for ok in (["--host", "127.0.0.1"], ["--host", "0.0.0.0", "--api-keys", "k1"],
               ["--host", "0.0.0.0", "--insecure-no-auth"]):  # fmt: skip
        assert exposure_error(parse(*ok)) is None  # type: ignore[arg-type]
    insecure = parse("--host", "0.0.0.0", "--insecure-no-auth")
    assert "INSECURE" in (insecure_banner(insecure) or "")  # type: ignore[arg-type]
    assert insecure_banner(parse("--host", "0.0.0.0", "--api-keys", "k")) is None  # type: ignore[arg-type]


def test_the_gateway_exits_2_before_it_listens(redis_server: EmbeddedRedis) -> None:
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "tokenrelay.core.cli", "gateway", "--redis-url", redis_server.url,
         "--host", "0.0.0.0", "--port", str(port), "--log-format", "json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = [json.loads(ln) for ln in proc.stderr.splitlines() if ln.startswith("{")]
    assert any("refusing to listen on 0.0.0.0" in ln["msg"] for ln in lines), proc.stderr


def test_serve_refuses_before_it_starts_anything(tmp_path: Path) -> None:
    """No Redis, no worker, no model load: one line and exit status 2."""
    data = tmp_path / "redis"
    proc = subprocess.run(
        [sys.executable, "-m", "tokenrelay.core.cli", "serve", "--host", "0.0.0.0",
         "--port", str(free_port()), "--data-dir", str(data)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "refusing to listen on 0.0.0.0 without API keys" in proc.stderr
    assert not data.exists()  # the embedded Redis never started
