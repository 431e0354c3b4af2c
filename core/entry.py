"""Resolve a command's handler by name, so the core never imports what sits above it.

The CLI and ``serve`` run the gateway and the worker, which depend on the core;
importing them here would point the dependency the wrong way. They name their
handlers as ``"package.module:function"`` strings instead (as uvicorn names an
app), resolved only when the command runs, which also keeps ``--help`` fast.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import cast

Handler = Callable[[argparse.Namespace], int]


class EntryError(RuntimeError):
    """A handler could not be loaded (for example a missing optional dependency)."""


def load(ref: str) -> Handler:
    """The function named by ``"module:function"``; :class:`EntryError` says why it is not there."""
    module_name, _, attr = ref.partition(":")
    if not attr:
        raise ValueError(f"entry {ref!r} is not of the form 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EntryError(f"{module_name} cannot be imported: {exc}") from exc
    handler = getattr(module, attr, None)
    if not callable(handler):
        raise EntryError(f"{module_name} has no function {attr!r}")
    return cast(Handler, handler)
