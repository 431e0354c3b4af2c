"""A protocol v1 client over gRPC for the tests: ``tokenrelay.v1.Relay/Chat`` calls."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from tests.gateway.procs import FrameReader
from tokenrelay.gateway.grpc.generated import load

CODE = load()
pb2 = CODE.pb2


def to_dict(msg: Any) -> dict[str, Any]:
    """A message's fields by name, defaults included (nested messages as dicts)."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None and not field.is_repeated:
            value = to_dict(value)
        out[field.name] = value
    return out


def frame_dict(frame: Any) -> dict[str, Any]:
    """A ``ServerFrame`` as ``{"type": kind, **fields}``, the shape of a WebSocket frame."""
    kind = frame.WhichOneof("frame")
    return {"type": kind, **to_dict(getattr(frame, kind))}


def generate(prompt: str, request_id: str, **params: Any) -> Any:
    """A ``Generate`` ClientFrame of one user message."""
    msg = pb2.Message(role="user", content=prompt)
    gen = pb2.Generate(request_id=request_id, messages=[msg], params=pb2.SamplingParams(**params))
    return pb2.ClientFrame(generate=gen)


class GrpcClient(FrameReader):
    """One ``Chat`` call on a channel of its own."""

    def __init__(self, channel: grpc.aio.Channel, call: Any) -> None:
        self.channel = channel
        self.call = call
        self.hello: dict[str, Any] = {}

    @classmethod
    async def open(
        cls, addr: str, key: str | None = None, *, hello: bool = True, origin: str | None = None
    ) -> GrpcClient:
        channel = grpc.aio.insecure_channel(addr)
        pairs = [("authorization", f"Bearer {key}")] if key else []
        pairs += [("origin", origin)] if origin else []
        metadata = tuple(pairs) or None
        client = cls(channel, CODE.pb2_grpc.RelayStub(channel).Chat(metadata=metadata))
        if hello:
            client.hello = await client.recv(10)
            assert client.hello["type"] == "hello", client.hello
        return client

    async def send(self, frame: Any = None, **fields: Any) -> None:
        await self.call.write(frame if frame is not None else pb2.ClientFrame(**fields))

    async def recv(self, timeout: float = 30.0) -> dict[str, Any]:
        msg = await asyncio.wait_for(self.call.read(), timeout)
        if msg is grpc.aio.EOF:
            raise EOFError("the call ended")
        return frame_dict(msg)

    async def close(self) -> None:
        """Drop the call (a detach: its streams go on), then the channel."""
        self.call.cancel()
        await self.channel.close()

    async def cut(self) -> None:
        """Close the channel at once, the call still open (the connection goes)."""
        await self.channel.close(grace=None)
