"""``--client-traceparent`` where every transport's request enters: ``StreamStore.create``.

HTTP, the WebSocket and gRPC all hand the client's ``traceparent`` (header, frame field,
metadata) to ``StreamStore.create``, which starts the ``gateway.receive`` span; here a real
store on the session's Redis with OpenTelemetry's in-memory exporter. The same over the
three transports of a running gateway: tests/gateway/test_tracing_e2e.py.
"""

from __future__ import annotations

import pytest

from tests.core.test_tracing import SPAN, TRACE, VALID, memory_tracing
from tokenrelay.core.tracing import ClientTrace
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.gateway.streams.store import StreamStore
from tokenrelay.worker.store import WorkerStore

pytest.importorskip("opentelemetry.sdk")


def test_the_default_links_a_client_traceparent() -> None:
    from tokenrelay.gateway.state import Gateway, Settings

    gw = Gateway(Settings(redis_url="redis://127.0.0.1:1"))
    assert gw.streams.client_trace is ClientTrace.LINK
    gw = Gateway(Settings(redis_url="redis://127.0.0.1:1", client_traceparent="ignore"))
    assert gw.streams.client_trace is ClientTrace.IGNORE


@pytest.mark.parametrize("policy", list(ClientTrace))
async def test_the_receive_span_follows_links_or_ignores_the_client(
    stream_store: StreamStore, worker_store: WorkerStore, policy: ClientTrace
) -> None:
    tracing, exporter = memory_tracing()
    stream_store.tracing, stream_store.client_trace = tracing, policy
    worker_store.heartbeat(WorkerStats())
    await stream_store.create({"prompt": "hi", "params": {}}, "r1", traceparent=VALID)
    spans = {s.name: s for s in exporter.get_finished_spans()}  # type: ignore[attr-defined]
    receive, enqueue = spans["gateway.receive"], spans["gateway.enqueue"]
    assert enqueue.parent.span_id == receive.context.span_id
    followed = f"{receive.context.trace_id:032x}" == TRACE
    links = [(f"{k.context.trace_id:032x}", f"{k.context.span_id:016x}") for k in receive.links]
    if policy is ClientTrace.FOLLOW:
        assert followed and f"{receive.parent.span_id:016x}" == SPAN and links == []
    else:
        assert receive.parent is None and not followed  # a trace of the gateway's own
        assert links == ([(TRACE, SPAN)] if policy is ClientTrace.LINK else [])
