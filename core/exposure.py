"""Whether a gateway may listen where it was asked to, given how it authenticates.

A gateway bound to a non-loopback address with no API keys serves anyone who can
reach the port: every model call, every stream. That must be a choice the operator
makes out loud (``--insecure-no-auth``), never the default of a container that
binds ``0.0.0.0``. Used by ``tokenrelay gateway`` and ``tokenrelay serve`` before
they start anything.
"""

from __future__ import annotations

import argparse
import ipaddress

INSECURE_FLAG = "--insecure-no-auth"


def is_loopback(host: str) -> bool:
    """``host`` is only reachable from this machine (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname or a wildcard: assume it is reachable from outside


def _unguarded(args: argparse.Namespace) -> bool:
    """A non-loopback ``--host`` with neither ``--api-keys`` nor ``--api-keys-file``."""
    keys = getattr(args, "api_keys", None) or getattr(args, "api_keys_file", None)
    return not keys and not is_loopback(str(args.host))


def exposure_error(args: argparse.Namespace) -> str | None:
    """Why ``gateway``/``serve`` must not start with these options, or ``None``.

    Refuses a non-loopback ``--host`` without ``--api-keys``/``--api-keys-file``
    unless ``--insecure-no-auth`` is given.
    """
    if not _unguarded(args) or getattr(args, "insecure_no_auth", False):
        return None
    return (
        f"refusing to listen on {args.host} without API keys: anyone who reaches the port could "
        f"use the model. Set --api-keys (or --api-keys-file), bind 127.0.0.1, or pass "
        f"{INSECURE_FLAG} (env TOKENRELAY_INSECURE_NO_AUTH=1) to serve without authentication"
    )


def insecure_banner(args: argparse.Namespace) -> str | None:
    """The warning to log when the operator chose to serve a network without keys."""
    if not _unguarded(args) or not getattr(args, "insecure_no_auth", False):
        return None
    return (
        f"INSECURE: listening on {args.host} with no API keys ({INSECURE_FLAG}): "
        "anyone who can reach this port can use the model"
    )
