"""The operations guide documents every command-line option and its environment variable."""

from __future__ import annotations

import argparse
from pathlib import Path

from core.cli import build_parser
from core.options import env_name

DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"


def test_every_flag_is_documented() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = DOC.read_text()
    missing = []
    for command in ("serve", "gateway", "worker"):
        for action in sub.choices[command]._actions:
            for flag in action.option_strings:
                if not flag.startswith("--") or flag == "--help":
                    continue
                if f"`{flag}`" not in text or f"`{env_name(flag)}`" not in text:
                    missing.append(f"{command} {flag}")
    assert not missing, f"undocumented in docs/operations.md: {missing}"
