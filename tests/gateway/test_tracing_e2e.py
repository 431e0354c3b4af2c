"""Tracing end to end: a gateway and an engine worker with ``--otlp-endpoint`` export their
spans over OTLP/HTTP to a receiver this test runs; one request per transport (HTTP, the
WebSocket, gRPC) with a client ``traceparent`` gives one trace with the spans of both
services, linked as docs/operations.md ("Tracing") says, on a gateway that follows the
client's trace (``--client-traceparent follow``). A second gateway with the default
(``link``) starts a trace of its own for each transport, linked to the client's."""

from __future__ import annotations

import asyncio
import gzip
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.procs import (
    Client,
    free_port,
    generate_frame,
    start_gateway,
    start_worker,
    stop_all,
    wait_ready,
)
from tokenrelay.core.redis.embedded import EmbeddedRedis

pytest.importorskip("opentelemetry.proto")
pytestmark = pytest.mark.slow

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

GATEWAY_SPANS = {"gateway.receive", "gateway.enqueue", "gateway.deliver"}
WORKER_SPANS = {"worker.queue_wait", "worker.prefill", "worker.decode", "worker.finish"}


@dataclass(frozen=True)
class Got:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    request_id: str
    links: tuple[tuple[str, str], ...] = ()


class Receiver:
    """A minimal OTLP/HTTP traces receiver (protobuf bodies) on a thread."""

    def __init__(self) -> None:
        self.spans: list[Got] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.take(body)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self, body: bytes) -> None:
        req = trace_service_pb2.ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                with self.lock:
                    self.spans += [
                        Got(attrs.get("service.name", ""), s.name, s.trace_id.hex(),
                            s.span_id.hex(), s.parent_span_id.hex(), _request_id(s),
                            tuple((k.trace_id.hex(), k.span_id.hex()) for k in s.links))
                        for s in ss.spans
                    ]  # fmt: skip

    def request(self, request_id: str) -> list[Got]:
        with self.lock:
            return [s for s in self.spans if s.request_id == request_id]

    def trace(self, trace_id: str) -> list[Got]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


def _request_id(span: Any) -> str:
    for a in span.attributes:
        if a.key == "tokenrelay.request_id":
            return str(a.value.string_value)
    return ""


@dataclass(frozen=True)
class Linking:
    """The second gateway: the default ``--client-traceparent`` (link)."""

    addr: str
    grpc_addr: str


@pytest.fixture(scope="module")
def gateways(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Receiver, str, str, Linking]]:
    receiver = Receiver()
    logs: Path = tmp_path_factory.mktemp("tracing-logs")
    prefix = f"trace{secrets.token_hex(3)}:"
    url, otlp = redis_server.url, ("--otlp-endpoint", receiver.url)
    grpc_port, link_grpc_port = free_port(), free_port()
    worker = start_worker(url, prefix, logs, *otlp)
    gw, addr = start_gateway(url, prefix, logs, *otlp, "--grpc-port", str(grpc_port),
                             "--client-traceparent", "follow")  # fmt: skip
    link_gw, link_addr = start_gateway(url, prefix, logs, *otlp, "--grpc-port", str(link_grpc_port))
    try:
        wait_ready(addr, gw, 300)
        wait_ready(link_addr, link_gw, 60)
        linking = Linking(link_addr, f"127.0.0.1:{link_grpc_port}")
        yield receiver, addr, f"127.0.0.1:{grpc_port}", linking
    finally:
        stop_all([worker, gw, link_gw])
        receiver.server.shutdown()


@pytest.fixture
def traced(gateways: tuple[Receiver, str, str, Linking]) -> tuple[Receiver, str, str]:
    return gateways[:3]


def new_traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


async def spans_of(receiver: Receiver, trace_id: str) -> dict[str, Got]:
    deadline = time.monotonic() + 60
    while True:
        got = {s.name: s for s in receiver.trace(trace_id)}
        if got.keys() >= GATEWAY_SPANS | WORKER_SPANS or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.2)


async def check_trace(receiver: Receiver, trace_id: str, client_span: str) -> None:
    got = await spans_of(receiver, trace_id)
    assert got.keys() >= GATEWAY_SPANS | WORKER_SPANS, sorted(got)
    for name in GATEWAY_SPANS:
        assert got[name].service == "tokenrelay-gateway", name
    for name in WORKER_SPANS:
        assert got[name].service == "tokenrelay-worker", name
    receive, enqueue = got["gateway.receive"], got["gateway.enqueue"]
    assert receive.parent == client_span
    assert enqueue.parent == receive.span_id
    assert got["gateway.deliver"].parent == receive.span_id
    for name in WORKER_SPANS:
        assert got[name].parent == enqueue.span_id, name


async def test_an_http_request_is_one_trace(traced: tuple[Receiver, str, str]) -> None:
    receiver, addr, _ = traced
    tp, trace_id, span_id = new_traceparent()
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    async with httpx.AsyncClient(timeout=120) as http:
        resp = await http.post(
            f"http://{addr}/v1/chat/completions", json=body, headers={"traceparent": tp}
        )
    assert resp.status_code == 200, resp.text
    await check_trace(receiver, trace_id, span_id)


async def test_a_websocket_generate_is_one_trace(traced: tuple[Receiver, str, str]) -> None:
    receiver, addr, _ = traced
    tp, trace_id, span_id = new_traceparent()
    c = await Client.open(addr)
    try:
        frame = {**generate_frame("Hi", "t-ws", max_tokens=3, temperature=0), "traceparent": tp}
        await c.send(frame)
        await c.recv_until(lambda f: f["type"] in ("done", "error"), 120)
    finally:
        await c.close()
    await check_trace(receiver, trace_id, span_id)


async def test_a_grpc_generate_is_one_trace(traced: tuple[Receiver, str, str]) -> None:
    import grpc

    from tests.gateway.grpc.client import CODE, GrpcClient, generate

    receiver, _, grpc_addr = traced
    tp, trace_id, span_id = new_traceparent()
    channel = grpc.aio.insecure_channel(grpc_addr)
    c = GrpcClient(channel, CODE.pb2_grpc.RelayStub(channel).Chat(metadata=(("traceparent", tp),)))
    try:
        assert (await c.recv(30))["type"] == "hello"
        await c.send(generate("Hi", "t-grpc", max_tokens=3, temperature=0))
        await c.recv_until(lambda f: f["type"] in ("done", "error"), 120)
    finally:
        await c.close()
    await check_trace(receiver, trace_id, span_id)


async def test_a_bad_traceparent_starts_a_new_trace(traced: tuple[Receiver, str, str]) -> None:
    receiver, addr, _ = traced
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    rid = "t-bad-" + secrets.token_hex(4)
    headers = {"traceparent": f"00-{'A' * 32}-{'b' * 16}-01", "x-request-id": rid}  # upper case
    async with httpx.AsyncClient(timeout=120) as http:
        resp = await http.post(f"http://{addr}/v1/completions", json=body, headers=headers)
    assert resp.status_code == 200, resp.text  # never an error
    deadline = time.monotonic() + 60
    while not (received := [s for s in receiver.request(rid) if s.name == "gateway.receive"]):
        assert time.monotonic() < deadline, "no receive span"
        await asyncio.sleep(0.2)
    assert received[0].parent == ""  # the root of a new trace
    assert received[0].trace_id != "a" * 32
    await check_trace(receiver, received[0].trace_id, "")


async def _http(addr: str, tp: str, rid: str) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    headers = {"traceparent": tp, "x-request-id": rid}
    async with httpx.AsyncClient(timeout=120) as http:
        resp = await http.post(f"http://{addr}/v1/completions", json=body, headers=headers)
    assert resp.status_code == 200, resp.text


async def _ws(addr: str, tp: str, rid: str) -> None:
    c = await Client.open(addr)
    try:
        await c.send({**generate_frame("Hi", rid, max_tokens=2, temperature=0), "traceparent": tp})
        await c.recv_until(lambda f: f["type"] in ("done", "error"), 120)
    finally:
        await c.close()


async def _grpc(addr: str, tp: str, rid: str) -> None:
    import grpc

    from tests.gateway.grpc.client import CODE, GrpcClient, generate

    channel = grpc.aio.insecure_channel(addr)
    c = GrpcClient(channel, CODE.pb2_grpc.RelayStub(channel).Chat(metadata=(("traceparent", tp),)))
    try:
        assert (await c.recv(30))["type"] == "hello"
        await c.send(generate("Hi", rid, max_tokens=2, temperature=0))
        await c.recv_until(lambda f: f["type"] in ("done", "error"), 120)
    finally:
        await c.close()


@pytest.mark.parametrize("transport", ["http", "ws", "grpc"])
async def test_by_default_a_clients_trace_is_linked_not_joined(
    gateways: tuple[Receiver, str, str, Linking], transport: str
) -> None:
    receiver, linking = gateways[0], gateways[3]
    tp, trace_id, span_id = new_traceparent()
    rid = f"t-link-{transport}-{secrets.token_hex(4)}"
    if transport == "http":
        await _http(linking.addr, tp, rid)
    elif transport == "ws":
        await _ws(linking.addr, tp, rid)
    else:
        await _grpc(linking.grpc_addr, tp, rid)
    deadline = time.monotonic() + 60
    while not (received := [s for s in receiver.request(rid) if s.name == "gateway.receive"]):
        assert time.monotonic() < deadline, "no receive span"
        await asyncio.sleep(0.2)
    (receive,) = received
    assert receive.parent == "" and receive.trace_id != trace_id  # the gateway's own trace
    assert receive.links == ((trace_id, span_id),)
    assert receiver.trace(trace_id) == []  # nothing joined the client's trace
    await check_trace(receiver, receive.trace_id, "")
