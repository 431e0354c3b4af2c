"""The `tokenrelay` command line: help, version, unknown subcommands."""

from __future__ import annotations

import subprocess
import sys

from tokenrelay.core.cli import main

SUBCOMMANDS = ("serve", "gateway", "worker", "model")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenrelay.core.cli", *args],
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
        [sys.executable, "-m", "tokenrelay.core.cli", "gateway", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "TOKENRELAY_PORT": "eighty"},
    )
    assert out.returncode != 0
    assert "TOKENRELAY_PORT" in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_hands_its_engine_flags_to_the_worker() -> None:
    """Every engine flag of serve reaches the worker child; a switch only when it is on."""
    from tokenrelay.core.cli import build_parser
    from tokenrelay.core.serve import worker_command

    flags = ["--attention-backend", "torch", "--block-size", "32", "--dtype", "float32"]
    args = build_parser().parse_args(["serve", *flags, "--enforce-eager"])
    cmd = worker_command(args)
    assert "--redis-url" not in cmd  # a password in it would show in ps: the env carries it
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enforce-eager" in cmd
    assert "--max-num-batched-tokens" not in cmd  # unset: the worker's engine picks per device
    worker_args = build_parser().parse_args(cmd[cmd.index("worker") :])
    assert worker_args.enforce_eager is True and worker_args.block_size == 32
    args = build_parser().parse_args(["serve"])
    assert "--enforce-eager" not in worker_command(args)


def test_serve_hands_its_upstream_to_the_worker_and_the_key_only_in_its_environment() -> None:
    from tokenrelay.core.cli import build_parser
    from tokenrelay.core.serve import worker_command, worker_env

    args = build_parser().parse_args(
        ["serve", "--redis-url", "redis://:pw@h/0", "--upstream", "http://h:8000/v1",
         "--upstream-model", "m", "--upstream-api-key", "sk-secret", "--max-inflight", "9"]
    )  # fmt: skip
    cmd = worker_command(args)
    assert "sk-secret" not in " ".join(cmd) and "pw@" not in " ".join(cmd)
    assert worker_env(args) == {"TOKENRELAY_REDIS_URL": "redis://:pw@h/0",
                                "TOKENRELAY_UPSTREAM_API_KEY": "sk-secret"}  # fmt: skip
    worker_args = build_parser().parse_args(cmd[cmd.index("worker") :])
    assert worker_args.upstream == "http://h:8000/v1" and worker_args.upstream_model == "m"
    assert worker_args.max_inflight == 9


def test_serve_with_a_bad_upstream_url_is_one_line() -> None:
    out = run_cli("serve", "--upstream", "localhost:11434", "--port", "0")
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "--upstream" in out.stderr


def test_serve_hands_redis_cluster_to_the_worker_and_needs_a_url() -> None:
    from tokenrelay.core.cli import build_parser
    from tokenrelay.core.serve import worker_command

    args = build_parser().parse_args(["serve", "--redis-url", "redis://h:7000", "--redis-cluster"])
    cmd = worker_command(args)
    worker_args = build_parser().parse_args(cmd[cmd.index("worker") :])
    assert worker_args.redis_cluster is True
    out = run_cli("serve", "--redis-cluster", "--port", "0")
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "--redis-cluster needs --redis-url" in out.stderr


def test_a_prefix_with_braces_is_one_line() -> None:
    out = run_cli("gateway", "--redis-url", "redis://127.0.0.1:1", "--redis-prefix", "a{b}:")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "braces" in out.stderr
