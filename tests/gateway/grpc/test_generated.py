"""The gRPC code (tokenrelay.v1) is built from proto/tokenrelay/v1/relay.proto with the
package and installed; it is never committed and never generated at run time."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2

from tests.root import ROOT
from tokenrelay.gateway.grpc import generated


def _compiled(proto_root: Path, tmp_path: Path) -> descriptor_pb2.FileDescriptorProto:
    """What protoc makes of the proto now, as a descriptor."""
    from grpc_tools import protoc

    out = tmp_path / "relay.desc"
    assert protoc.main(["protoc", f"-I{proto_root}", f"--descriptor_set_out={out}",
                        generated.PROTO]) == 0  # fmt: skip
    (file,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    _drop_json_names(file.message_type)  # the Python generator leaves them out
    return file


def _drop_json_names(messages: Any) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _drop_json_names(message.nested_type)


def test_the_installed_code_is_the_proto_as_it_is_now(tmp_path: Path) -> None:
    """A stale build (the proto edited since the install) fails here: `make install` again."""
    code = generated.load()
    assert code.pb2.__name__ == "tokenrelay.v1.relay_pb2"
    loaded = descriptor_pb2.FileDescriptorProto.FromString(code.pb2.DESCRIPTOR.serialized_pb)
    assert loaded == _compiled(ROOT / "proto", tmp_path)
    assert loaded.package == generated.PACKAGE
    assert hasattr(code.pb2_grpc, "RelayStub") and hasattr(code.pb2_grpc, "RelayServicer")


def test_nothing_is_generated_at_run_time() -> None:
    source = "\n".join(p.read_text() for p in (ROOT / "gateway" / "grpc").glob("*.py"))
    assert "grpc_tools" not in source and "protoc." not in source


def test_no_generated_code_is_in_git() -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()  # fmt: skip
    assert not [f for f in files if f.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))]
    assert not [f for f in files if f.startswith("proto/") and f.endswith(".py")]
