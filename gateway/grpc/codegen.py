"""The Python code of ``proto/tokenrelay/v1/relay.proto``, generated at first use.

Nothing generated is kept in git: :func:`generated_dir` runs ``grpc_tools.protoc`` once
into ``$TOKENRELAY_HOME/grpc/<key>/`` (``key``: a hash of the proto's bytes and of the
grpcio-tools and protobuf versions, so an edited proto or an upgrade generates afresh),
writing into a temporary folder renamed into place when complete (two processes racing
both generate; one rename wins, the other's copy is removed). :func:`load` imports the
two modules, ``tokenrelay.v1.relay_pb2`` (messages) and ``tokenrelay.v1.relay_pb2_grpc``
(stub and servicer), from there without touching ``sys.path``.

The proto is found with :func:`core.runtime.asset_dir`: ``proto/`` of a checkout, else
the data files a wheel installs under ``<prefix>/share/tokenrelay/proto``.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import sys
import tempfile
import types
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from core.runtime import asset_dir, tokenrelay_home

PROTO = "tokenrelay/v1/relay.proto"  # its path under proto/: also its name in descriptors
PACKAGE = "tokenrelay.v1"
SERVICE = "tokenrelay.v1.Relay"  # the full service name (health, reflection)


@dataclass(frozen=True)
class Generated:
    """The generated modules: ``pb2`` (messages) and ``pb2_grpc`` (``RelayStub`` ...)."""

    pb2: Any
    pb2_grpc: Any
    folder: Path  # the cache folder they were imported from


def proto_path() -> Path:
    """The relay.proto this installation serves."""
    return asset_dir("proto") / PROTO


def cache_key(proto: bytes) -> str:
    """What the generated code depends on: the proto, the generator, the runtime."""
    h = hashlib.sha256(proto)
    for dist in ("grpcio-tools", "protobuf"):
        try:
            h.update(f"\0{dist}={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"\0{dist}=?".encode())
    return h.hexdigest()[:20]


def generate(proto_root: Path, out: Path) -> None:
    """Run protoc on ``proto_root/tokenrelay/v1/relay.proto`` into ``out`` (Python + gRPC)."""
    from grpc_tools import protoc  # only here: a gateway without --grpc-port never loads it

    includes = resources.files("grpc_tools") / "_proto"  # the well-known types
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{includes}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        PROTO,
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed on {proto_root / PROTO} (exit status {code})")


def generated_dir(proto: Path | None = None, home: Path | None = None) -> Path:
    """The cache folder holding the code of ``proto`` (default: :func:`proto_path`),
    generated now when it is not there yet."""
    proto = proto or proto_path()
    if proto.as_posix().endswith(PROTO):
        proto_root = Path(proto.as_posix()[: -len(PROTO)] or ".")
    else:
        raise ValueError(f"{proto}: the proto must sit at <folder>/{PROTO}")
    base = (home or tokenrelay_home()) / "grpc"
    final = base / cache_key(proto.read_bytes())
    if (final / "tokenrelay" / "v1" / "relay_pb2_grpc.py").is_file():
        return final
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gen-", dir=base))
    try:
        generate(proto_root, tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: keep its copy
            if not (final / "tokenrelay" / "v1" / "relay_pb2_grpc.py").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _package(name: str, folder: Path) -> None:
    """Register ``name`` as a package whose modules live in ``folder``."""
    existing = sys.modules.get(name)
    if existing is not None:
        paths = list(getattr(existing, "__path__", []))
        if str(folder) not in paths:
            raise RuntimeError(
                f"a different {name!r} package is already imported (from {paths}): "
                f"cannot load the generated code from {folder}"
            )
        return
    module = types.ModuleType(name, f"generated from {PROTO}")
    module.__path__ = [str(folder)]
    module.__package__ = name
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


def load(proto: Path | None = None, home: Path | None = None) -> Generated:
    """Import the generated modules (generating them first when needed).

    One process serves one proto: loading the code of another relay.proto after the
    first raises ``RuntimeError`` (protobuf registers each file name once).
    """
    folder = generated_dir(proto, home)
    _package("tokenrelay", folder / "tokenrelay")
    _package(PACKAGE, folder / "tokenrelay" / "v1")
    pb2 = importlib.import_module(f"{PACKAGE}.relay_pb2")
    pb2_grpc = importlib.import_module(f"{PACKAGE}.relay_pb2_grpc")
    return Generated(pb2, pb2_grpc, folder)
