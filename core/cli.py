"""The ``tokenrelay`` command: serve, gateway, worker, model."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tokenrelay.core.entry import EntryError, Handler, load
from tokenrelay.core.runtime import version

# subcommand -> its handler, resolved when it runs (core/entry.py)
ENTRIES = {
    "serve": "tokenrelay.core.serve:main",
    "gateway": "tokenrelay.gateway.server:main",
    "worker": "tokenrelay.worker.main:main",
    "model": "tokenrelay.worker.model_command:main",
}


def _handler(command: str) -> Handler:
    def run(args: argparse.Namespace) -> int:
        try:
            handler = load(ENTRIES[command])
        except EntryError as exc:
            print(f"tokenrelay {command}: {exc}", file=sys.stderr)
            return 1
        return handler(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenrelay",
        description="Real-time conversational gateway for LLMs.",
    )
    parser.add_argument("--version", action="version", version=f"tokenrelay {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from tokenrelay.core.options import add_gateway_options, add_serve_options, add_worker_options

    p = sub.add_parser("serve", help="embedded Redis + one engine worker + the gateway")
    add_serve_options(p)
    p.set_defaults(handler=_handler("serve"))

    p = sub.add_parser("gateway", help="the WebSocket/HTTP gateway alone (shared Redis)")
    add_gateway_options(p)
    p.set_defaults(handler=_handler("gateway"))

    p = sub.add_parser("worker", help="one engine worker alone (shared Redis)")
    add_worker_options(p)
    p.set_defaults(handler=_handler("worker"))

    p = sub.add_parser("model", help="prepare or list cached models")
    msub = p.add_subparsers(dest="model_cmd", metavar="ACTION", required=True)
    prep = msub.add_parser("prepare", help="convert a model once (default: the default model)")
    prep.add_argument("name", nargs="?", default="default", help="default, a HF folder or .gguf")
    msub.add_parser("list", help="show prepared models")
    p.set_defaults(handler=_handler("model"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from tokenrelay.core.logs import setup_logging

    try:
        parser = build_parser()
    except ValueError as exc:  # a bad TOKENRELAY_* value in the environment
        print(f"tokenrelay: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        setup_logging(getattr(args, "log_level", None), getattr(args, "log_format", None))
        code: int = args.handler(args)
    except ValueError as exc:
        print(f"tokenrelay: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
