"""``tokenrelay model``: prepare (convert once) or list the models a worker can load."""

from __future__ import annotations

import argparse
import sys


def main(args: argparse.Namespace) -> int:
    """Entry point of ``tokenrelay model prepare|list``."""
    try:
        from tokenrelay.engine.errors import ModelNotFoundError
        from tokenrelay.engine.models.store import list_cached, resolve_model
    except ModuleNotFoundError as exc:  # a base install: ValueError, one line, exit 2
        from tokenrelay.worker.engine_client import engine_missing

        raise engine_missing(exc) from exc

    if args.model_cmd == "prepare":
        try:
            path = resolve_model(args.name)
        except ModelNotFoundError as exc:
            print(f"tokenrelay: {exc}", file=sys.stderr)
            return 1
        print(path)
        return 0
    models = list_cached()
    if not models:
        print("no prepared models (run `tokenrelay model prepare`)")
    for m in models:
        print(f"{m.name}\t{m.size_bytes / 2**20:.1f} MiB\t{m.path}")
    return 0
