"""``tokenrelay.v1.Relay/Chat`` in-process: auth, bad frames, health, reflection, drain.

A real gateway (``Gateway`` on the session's redis-server, its own key prefix) with its
:class:`GrpcServer`; no engine worker, so a ``generate`` is refused with ``unavailable``
and nothing here runs a model. Streams over gRPC end to end: tests/e2e/test_chaos_grpc.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.gateway.grpc.client import GrpcClient, generate, pb2
from tests.gateway.procs import free_port
from tests.root import ROOT
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.gateway.access.auth import SecuritySettings
from tokenrelay.gateway.grpc.generated import PROTO, SERVICE
from tokenrelay.gateway.grpc.server import GrpcServer
from tokenrelay.gateway.server import build_server
from tokenrelay.gateway.state import Gateway, Settings

KEY = "grpc-test-key-0123456789"


@pytest.fixture
async def addr(redis_server: EmbeddedRedis, prefix: str) -> AsyncIterator[str]:
    security = SecuritySettings(api_keys=(KEY,), max_streams_per_key=4)
    gw = Gateway(Settings(redis_url=redis_server.url, redis_prefix=prefix, security=security))
    await gw.start()
    server = GrpcServer(gw, "127.0.0.1", free_port())
    port = await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop()
        await gw.stop()


@pytest.mark.parametrize("key", [None, "wrong-key", ""])
async def test_a_call_without_a_valid_key_ends_unauthenticated(addr: str, key: str | None) -> None:
    c = await GrpcClient.open(addr, key, hello=False)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.recv(10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "key" in (err.value.details() or "").lower()
    finally:
        await c.close()


async def test_origins_are_checked_as_for_the_websocket(addr: str) -> None:
    c = await GrpcClient.open(addr, KEY, hello=False, origin="https://evil.example")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.recv(10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await c.close()
    local = await GrpcClient.open(addr, KEY, origin="http://localhost:5173")  # a dev server
    try:
        assert local.hello["type"] == "hello"
    finally:
        await local.close()


async def test_hello_ping_and_bad_frames_leave_the_call_usable(addr: str) -> None:
    c = await GrpcClient.open(addr, KEY)
    try:
        assert c.hello["protocol"] == 1 and c.hello["heartbeat_s"] > 0
        assert c.hello["worker_ready"] is False  # no engine worker here
        await c.send(ping=pb2.Ping())
        assert (await c.recv())["type"] == "pong"
        bad = [
            (pb2.ClientFrame(), "bad_request", "empty ClientFrame"),
            (pb2.ClientFrame(generate=pb2.Generate(request_id="r1")), "bad_request", "messages"),
            (generate("hi", "r2", temperature=7.0), "bad_request", "temperature"),
            (generate("hi", "r3", tools_json="{nope"), "bad_request", "tools_json"),
            (generate("hi", "r4", logprobs=99), "bad_request", "logprobs"),
            (pb2.ClientFrame(generate=pb2.Generate(request_id="bad id!", prompt="x")),
             "bad_request", "request_id"),
            (pb2.ClientFrame(resume=pb2.Resume(stream_id="nope", resume_token="t")),
             "not_found", "no such stream"),
            (pb2.ClientFrame(resume=pb2.Resume(stream_id="A" * 22)), "bad_request",
             "resume_token"),
            (pb2.ClientFrame(resume=pb2.Resume(stream_id="A" * 22, resume_token="t")),
             "not_found", ""),
            (pb2.ClientFrame(cancel=pb2.Cancel(stream_id="A" * 22)), "not_found", ""),
        ]  # fmt: skip
        for frame, code, words in bad:
            await c.send(frame)
            error = await c.recv()
            assert error["type"] == "error" and error["code"] == code, (frame, error)
            assert words in error["message"], error
        assert error["stream_id"] == "A" * 22
        # a well-formed generate: no worker is alive, so `unavailable`, with the request id
        await c.send(generate("Say hi.", "r5", max_tokens=4, temperature=0.0))
        error = await c.recv()
        assert (error["type"], error["code"], error["request_id"]) == ("error", "unavailable", "r5")
        await c.send(ping=pb2.Ping())
        assert (await c.recv())["type"] == "pong"
    finally:
        await c.close()


async def test_a_message_over_max_frame_bytes_ends_the_call(addr: str) -> None:
    c = await GrpcClient.open(addr, KEY)
    try:
        await c.send(pb2.ClientFrame(generate=pb2.Generate(prompt="x" * (2 << 20))))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.recv(10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await c.close()


async def test_a_half_closed_call_without_streams_ends_ok(addr: str) -> None:
    c = await GrpcClient.open(addr, KEY)
    try:
        await c.call.done_writing()
        with pytest.raises(EOFError):
            await c.recv(10)
        assert await c.call.code() == grpc.StatusCode.OK
    finally:
        await c.close()


async def test_health_says_serving_and_the_relay_not_ready_without_a_worker(addr: str) -> None:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        overall = await stub.Check(health_pb2.HealthCheckRequest(service=""))
        relay = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE))
    assert overall.status == health_pb2.HealthCheckResponse.SERVING
    assert relay.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_reflection_lists_the_services_and_serves_the_proto(addr: str) -> None:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
        ]
        answers = [a async for a in stub.ServerReflectionInfo(iter(requests))]
    names = {s.name for s in answers[0].list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names
    raw = answers[1].file_descriptor_response.file_descriptor_proto
    files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in raw]
    relay = next(f for f in files if f.name == PROTO)
    (service,) = relay.service
    (chat,) = service.method
    assert (service.name, chat.name, chat.client_streaming, chat.server_streaming) == (
        "Relay", "Chat", True, True)  # fmt: skip


async def test_a_port_in_use_fails_clearly(redis_server: EmbeddedRedis, prefix: str) -> None:
    gw = Gateway(Settings(redis_url=redis_server.url, redis_prefix=prefix))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = GrpcServer(gw, "127.0.0.1", taken.getsockname()[1])
        with pytest.raises(RuntimeError, match="cannot listen for gRPC"):
            await server.start()
    with pytest.raises(ValueError, match="--grpc-port"):
        GrpcServer(gw, "127.0.0.1", 70000)
    await gw.streams.close()


def test_a_gateway_without_grpc_port_never_imports_grpc() -> None:
    probe = (
        "import sys, tokenrelay.gateway.server, tokenrelay.gateway.app;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('grpc', 'grpc_tools', 'grpc_health', 'grpc_reflection', 'google'));"
        "bad += [m for m in sys.modules if m.startswith('tokenrelay.gateway.grpc')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_build_server_checks_the_grpc_port() -> None:
    settings = Settings(redis_url="redis://127.0.0.1:1")
    with pytest.raises(ValueError, match="differ"):
        build_server(settings, "127.0.0.1", 8000, grpc_port=8000)
    with pytest.raises(ValueError, match="65535"):
        build_server(settings, "127.0.0.1", 8000, grpc_port=-1)
    assert build_server(settings, "127.0.0.1", 8000, grpc_port=50051).grpc_port == 50051
