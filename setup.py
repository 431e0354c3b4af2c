"""The build step pyproject.toml cannot say: the gRPC code.

``tokenrelay.v1`` (``relay_pb2``, ``relay_pb2_grpc``) is generated from
``proto/tokenrelay/v1/relay.proto`` by ``grpc_tools.protoc`` (a build requirement) into
that same folder, at every build: wheels and editable installs alike. The generated
files are never committed (.gitignore). The packages and their folders are in
pyproject.toml.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE / "proto"
PROTO = "tokenrelay/v1/relay.proto"
GENERATED = PROTO_ROOT / "tokenrelay" / "v1"  # the package tokenrelay.v1


def generate_grpc() -> None:
    """Run protoc on the proto: ``relay_pb2.py`` and ``relay_pb2_grpc.py`` beside it."""
    from importlib import resources

    from grpc_tools import protoc

    well_known = resources.files("grpc_tools") / "_proto"
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}",
            f"--python_out={PROTO_ROOT}", f"--grpc_python_out={PROTO_ROOT}", PROTO]  # fmt: skip
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {PROTO_ROOT / PROTO}")
    init = GENERATED / "__init__.py"
    if not init.is_file():
        init.write_text(f'"""Generated from {PROTO} at build time."""\n')


class BuildPy(build_py):
    """``build_py`` that generates the gRPC modules first (editable installs run it too)."""

    def run(self) -> None:
        generate_grpc()
        super().run()


setup(cmdclass={"build_py": BuildPy})
