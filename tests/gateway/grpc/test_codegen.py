"""The gRPC code is generated from proto/tokenrelay/v1/relay.proto, never committed."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2

from gateway.grpc import codegen
from tests.root import ROOT


def _compiled(proto_root: Path, tmp_path: Path) -> descriptor_pb2.FileDescriptorProto:
    """What protoc makes of the proto now, as a descriptor."""
    from grpc_tools import protoc

    out = tmp_path / "relay.desc"
    assert protoc.main(["protoc", f"-I{proto_root}", f"--descriptor_set_out={out}",
                        codegen.PROTO]) == 0  # fmt: skip
    (file,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    _drop_json_names(file.message_type)  # the Python generator leaves them out
    return file


def _drop_json_names(messages: Any) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _drop_json_names(message.nested_type)


def test_the_loaded_code_is_the_proto_as_it_is_now(tmp_path: Path) -> None:
    code = codegen.load()
    assert codegen.proto_path() == ROOT / "proto" / codegen.PROTO
    loaded = descriptor_pb2.FileDescriptorProto.FromString(code.pb2.DESCRIPTOR.serialized_pb)
    assert loaded == _compiled(ROOT / "proto", tmp_path)
    assert loaded.package == codegen.PACKAGE
    assert code.folder.name == codegen.cache_key(codegen.proto_path().read_bytes())
    assert hasattr(code.pb2_grpc, "RelayStub") and hasattr(code.pb2_grpc, "RelayServicer")


def test_an_edited_proto_is_generated_afresh(tmp_path: Path) -> None:
    home = tmp_path / "home"
    edited = tmp_path / "proto" / codegen.PROTO
    edited.parent.mkdir(parents=True)
    text = codegen.proto_path().read_text()
    edited.write_text(text)
    first = codegen.generated_dir(edited, home)
    assert codegen.generated_dir(edited, home) == first  # cached
    edited.write_text(text.replace("message Ping {}", "message Ping { string note = 1; }"))
    second = codegen.generated_dir(edited, home)
    assert second != first
    assert "note" in (second / "tokenrelay" / "v1" / "relay_pb2.py").read_text()
    assert sorted(p.name for p in (home / "grpc").iterdir()) == sorted([first.name, second.name])


def test_a_broken_proto_fails_clearly(tmp_path: Path) -> None:
    broken = tmp_path / "proto" / codegen.PROTO
    broken.parent.mkdir(parents=True)
    broken.write_text('syntax = "proto3";\nmessage {')
    with pytest.raises(RuntimeError, match="protoc failed"):
        codegen.generated_dir(broken, tmp_path / "home")
    with pytest.raises(ValueError, match="must sit at"):
        codegen.generated_dir(tmp_path / "relay.proto", tmp_path / "home")


def test_no_generated_code_is_in_git() -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()  # fmt: skip
    assert not [f for f in files if f.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))]
    assert not list((ROOT / "proto").rglob("*.py"))
