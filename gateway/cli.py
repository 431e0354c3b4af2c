"""The ``tokenrelay`` command: serve, gateway, worker, model."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

Handler = Callable[[argparse.Namespace], int]


def _version() -> str:
    try:
        return metadata.version("tokenrelay")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _cmd_model(args: argparse.Namespace) -> int:
    from engine.model_store import ModelNotFoundError, list_cached, resolve_model

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


def _not_yet(name: str) -> Handler:
    def run(args: argparse.Namespace) -> int:
        print(f"tokenrelay {name}: not available yet", file=sys.stderr)
        return 1

    return run


def _lazy(module: str, name: str) -> Handler:
    """Import the handler only when its subcommand runs (keeps --help fast)."""

    def run(args: argparse.Namespace) -> int:
        try:
            mod = __import__(module, fromlist=["main"])
        except ImportError:
            return _not_yet(name)(args)
        handler: Handler = mod.main
        return handler(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenrelay",
        description="Real-time conversational gateway for LLMs.",
    )
    parser.add_argument("--version", action="version", version=f"tokenrelay {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from gateway.options import add_gateway_options, add_serve_options, add_worker_options

    p = sub.add_parser("serve", help="embedded Redis + one engine worker + the gateway")
    add_serve_options(p)
    p.set_defaults(handler=_lazy("gateway.serve", "serve"))

    p = sub.add_parser("gateway", help="the WebSocket/HTTP gateway alone (shared Redis)")
    add_gateway_options(p)
    p.set_defaults(handler=_lazy("gateway.server", "gateway"))

    p = sub.add_parser("worker", help="one engine worker alone (shared Redis)")
    add_worker_options(p)
    p.set_defaults(handler=_lazy("engine.worker", "worker"))

    p = sub.add_parser("model", help="prepare or list cached models")
    msub = p.add_subparsers(dest="model_cmd", metavar="ACTION", required=True)
    prep = msub.add_parser("prepare", help="convert a model once (default: the default model)")
    prep.add_argument("name", nargs="?", default="default", help="default, a HF folder or .gguf")
    msub.add_parser("list", help="show prepared models")
    p.set_defaults(handler=_cmd_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from gateway.logs import setup_logging

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
