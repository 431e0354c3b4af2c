"""The Python code of ``proto/tokenrelay/v1/relay.proto``: ``tokenrelay.v1``.

The modules ``tokenrelay.v1.relay_pb2`` (messages) and ``tokenrelay.v1.relay_pb2_grpc``
(stub and servicer) are generated when tokenrelay is built (setup.py: wheels and
editable installs alike) and installed beside the other packages; nothing generates code
at run time. :func:`load` imports them, or says in one line what to install.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from tokenrelay.gateway.errors import GrpcUnavailable

PROTO = "tokenrelay/v1/relay.proto"  # its path under proto/: also its name in descriptors
PACKAGE = "tokenrelay.v1"
SERVICE = "tokenrelay.v1.Relay"  # the full service name (health, reflection)
EXTRA = "pip install 'tokenrelay[grpc]'"


@dataclass(frozen=True)
class Generated:
    """The generated modules: ``pb2`` (messages) and ``pb2_grpc`` (``RelayStub`` ...)."""

    pb2: Any
    pb2_grpc: Any


def load() -> Generated:
    """Import the installed ``tokenrelay.v1`` modules; :class:`GrpcUnavailable` if absent."""
    try:
        import google.protobuf  # noqa: F401
        import grpc  # noqa: F401
    except ImportError as exc:
        raise GrpcUnavailable(f"--grpc-port needs grpcio and protobuf ({EXTRA}): {exc}") from exc
    try:
        pb2 = importlib.import_module(f"{PACKAGE}.relay_pb2")
        pb2_grpc = importlib.import_module(f"{PACKAGE}.relay_pb2_grpc")
    except ImportError as exc:
        raise GrpcUnavailable(
            f"the gRPC code {PACKAGE} is not installed ({exc}): it is built with the "
            f"package; reinstall tokenrelay ({EXTRA}, or `pip install -e .` in a checkout)"
        ) from exc
    return Generated(pb2, pb2_grpc)
