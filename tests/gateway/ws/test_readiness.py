"""The readiness frames: ``hello.worker_ready``, then one ``worker_ready`` notice.

A real gateway with no worker; a worker's heartbeat written into Redis (as a worker does
once its model is loaded) makes it ready. The pages that follow these frames are tested
in tests/web/test_readiness.py (same fixture).
"""

from __future__ import annotations

import asyncio

from tests.gateway.procs import Client
from tests.web.test_readiness import bare_gateway  # noqa: F401  (the fixture)
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.worker.store import WorkerStore


async def test_hello_and_notices_carry_readiness(
    bare_gateway: tuple[str, WorkerStore],  # noqa: F811  (the imported fixture)
) -> None:
    """A socket told "not ready" hears when a worker is; one told "ready" hears nothing."""
    addr, worker_store = bare_gateway
    c = await Client.open(addr)
    try:
        assert c.hello["worker_ready"] is False
        worker_store.heartbeat(WorkerStats())
        notice = await c.recv(10)
        assert notice["type"] == "notice" and notice["code"] == "worker_ready", notice
        late = await Client.open(addr)
        assert late.hello["worker_ready"] is True
        worker_store.unregister()  # workers coming and going: no notice interleaves with streams
        await asyncio.sleep(4)  # past the heartbeat's expiry and a few readiness checks
        for client in (c, late):
            await client.send({"type": "ping"})
            assert (await client.recv(5))["type"] == "pong"
        await late.close()
    finally:
        await c.close()
