"""``--tensor-parallel-size`` reaches the engine's config, checked before anything loads."""

from __future__ import annotations

import pytest

from tokenrelay.core.cli import build_parser
from tokenrelay.core.serve import worker_command
from tokenrelay.worker.engine_client import engine_config


def test_the_worker_flag_sets_the_engines_tensor_parallel_size() -> None:
    args = build_parser().parse_args(["worker", "--device", "cpu", "--tensor-parallel-size", "3"])
    assert engine_config(args).tensor_parallel_size == 3
    args = build_parser().parse_args(["worker", "--device", "cpu"])
    assert engine_config(args).tensor_parallel_size == 1


def test_a_size_that_does_not_divide_the_heads_is_one_clear_error() -> None:
    args = build_parser().parse_args(["worker", "--device", "cpu", "--tensor-parallel-size", "2"])
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 does not divide"):
        engine_config(args)


def test_serve_hands_the_size_to_its_worker() -> None:
    cmd = worker_command(build_parser().parse_args(["serve", "--tensor-parallel-size", "3"]))
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "3"
