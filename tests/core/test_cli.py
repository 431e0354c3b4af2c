"""The `tokenrelay` command line: help, version, unknown subcommands."""

from __future__ import annotations

import subprocess
import sys

from core.cli import main

SUBCOMMANDS = ("serve", "gateway", "worker", "model")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "core.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_help_lists_subcommands() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    for name in SUBCOMMANDS:
        assert name in out.stdout


def test_version() -> None:
    out = run_cli("--version")
    assert out.returncode == 0
    assert out.stdout.startswith("tokenrelay ")
    assert "0.1" in out.stdout


def test_unknown_subcommand_is_a_clear_error() -> None:
    out = run_cli("frobnicate")
    assert out.returncode == 2
    assert "invalid choice" in out.stderr
    assert "Traceback" not in out.stderr


def test_no_subcommand_is_a_clear_error() -> None:
    out = run_cli()
    assert out.returncode == 2
    assert "Traceback" not in out.stderr


def test_bad_model_name_is_one_line(capsys) -> None:  # type: ignore[no-untyped-def]
    code = main(["model", "prepare", "/no/such/model/anywhere"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1
    assert "/no/such/model/anywhere" in err


def test_bad_env_value_is_a_clear_error(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TOKENRELAY_PORT", "eighty")
    out = subprocess.run(
        [sys.executable, "-m", "core.cli", "gateway", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "TOKENRELAY_PORT": "eighty"},
    )
    assert out.returncode != 0
    assert "TOKENRELAY_PORT" in out.stderr
    assert "Traceback" not in out.stderr
