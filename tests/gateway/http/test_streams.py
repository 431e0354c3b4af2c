"""gateway/http/streams.py in process, on real Redis: a resume never leaks its attachment.

Issue 19: a stream whose stored request id a header cannot carry made the resume
answer fail after the stream was attached, and the attachment stayed (refreshed
in Redis for as long as the gateway lived). Also: the resume token's header form.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request
from starlette.types import Message

from tokenrelay.gateway.access.auth import SecuritySettings
from tokenrelay.gateway.access.guard import Guard
from tokenrelay.gateway.http.common import HttpSettings
from tokenrelay.gateway.http.streams import StreamsApi
from tokenrelay.gateway.streams.readers import StreamReaders
from tokenrelay.gateway.streams.store import StreamStore
from tokenrelay.worker.store import WorkerStore

BODY = {"prompt": "hi", "params": {}}


class Client:
    """The ASGI side of one resume: validates headers as h11 does, can leave."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.left = asyncio.Event()

    async def receive(self) -> Message:
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            for _, value in message["headers"]:
                if b"\r" in value or b"\n" in value:
                    raise RuntimeError("Illegal header value")
        self.sent.append(message)


def api_of(stream_store: StreamStore) -> StreamsApi:
    gw: Any = SimpleNamespace(
        streams=stream_store,
        settings=SimpleNamespace(model_name="m", max_frame_bytes=1 << 16),
        guard=Guard(SecuritySettings(), stream_store.draw_tokens),
        readers=StreamReaders(),
    )
    return StreamsApi(gw, HttpSettings(keepalive=30))


def request(sid: str, client: Client, query: str = "", **headers: str) -> Request:
    scope = {
        "type": "http",
        "method": "GET",
        "path": f"/v1/streams/{sid}/events",
        "path_params": {"stream_id": sid},
        "query_string": query.encode(),
        "headers": [(k.lower().encode(), v.encode("latin-1")) for k, v in headers.items()],
    }
    return Request(scope, client.receive)


async def attached(stream_store: StreamStore, sid: str) -> int:
    return int(await stream_store.redis.zcard(stream_store.keys.attach(sid)))


async def resume_and_leave(
    stream_store: StreamStore, rid: str, leave_first: bool
) -> dict[str, str]:
    """Resume a queued stream whose request id is ``rid``; the client then leaves."""
    new = await stream_store.create(BODY, rid, attach=False)
    client = Client()
    req = request(new.stream_id, client, f"resume_token={new.resume_token}")
    resp = await api_of(stream_store).events(req)
    assert resp.status_code == 200
    assert (
        await attached(stream_store, new.stream_id) == 1
        and len(stream_store.attachments.tracked) == 1
    )
    if leave_first:
        client.left.set()
    else:
        asyncio.get_running_loop().call_later(0.2, client.left.set)
    await asyncio.wait_for(resp(req.scope, client.receive, client.send), 10)
    assert not stream_store.attachments.tracked, "the attachment outlived the answer"
    assert await attached(stream_store, new.stream_id) == 0
    return {k.decode(): v.decode("latin-1") for k, v in resp.raw_headers}


@pytest.mark.parametrize("rid", ["r\u2603", "r1\r\nX-Evil: 1", "caf\u00e9"], ids=repr)
async def test_resume_of_a_stream_with_an_unsafe_request_id(
    stream_store: StreamStore, worker_store: WorkerStore, rid: str
) -> None:
    """Stored before ids were checked: the answer leaves the header out, and detaches."""
    headers = await resume_and_leave(stream_store, rid, leave_first=False)
    assert "x-request-id" not in headers and "x-stream-id" in headers


async def test_resume_with_a_safe_request_id_echoes_it(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    headers = await resume_and_leave(stream_store, "req-1.a:b_c", leave_first=True)
    assert headers["x-request-id"] == "req-1.a:b_c"


async def test_attachment_released_when_the_headers_cannot_be_sent(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    new = await stream_store.create(BODY, "r1", attach=False)
    client = Client()
    req = request(new.stream_id, client, f"resume_token={new.resume_token}")
    resp = await api_of(stream_store).events(req)
    assert len(stream_store.attachments.tracked) == 1

    async def refused(message: Message) -> None:  # the client left before the headers
        raise OSError("connection reset")

    await asyncio.wait_for(resp(req.scope, client.receive, refused), 10)
    assert not stream_store.attachments.tracked and await attached(stream_store, new.stream_id) == 0


async def test_resume_token_in_a_header_or_the_query(
    stream_store: StreamStore, worker_store: WorkerStore
) -> None:
    new = await stream_store.create(BODY, "r1", attach=False)
    sid, token = new.stream_id, new.resume_token
    api = api_of(stream_store)
    both = ("resume_token=not-the-token", {"X-Resume-Token": token})  # the header wins
    for query, headers in (("", {"X-Resume-Token": token}), (f"resume_token={token}", {}), both):
        client = Client()
        client.left.set()
        req = request(sid, client, query, **headers)
        resp = await api.events(req)
        assert resp.status_code == 200, resp.body
        await asyncio.wait_for(resp(req.scope, client.receive, client.send), 10)
    assert not stream_store.attachments.tracked
    bad = [
        ("", {"X-Resume-Token": "t" * 129}, 400, "X-Resume-Token"),
        ("resume_token=" + "t" * 100_000, {}, 400, "resume_token"),
        ("resume_token=a%0Ab", {}, 400, "resume_token"),
        ("", {"X-Resume-Token": "wrong"}, 403, None),
        ("", {}, 401, None),
    ]
    for query, headers, status, param in bad:
        resp = await api.events(request(sid, Client(), query, **headers))
        assert resp.status_code == status, (query[:40], headers, resp.body)
        if param is not None:
            assert bytes(resp.body).count(f'"param":"{param}"'.encode()) == 1
    assert not stream_store.attachments.tracked
