"""worker/store.py: a worker reads only the request queues of the models it serves."""

from __future__ import annotations

import json
import secrets

from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.keys import GROUP
from tokenrelay.worker.store import Batch, WorkerStore


def queue_request(store: WorkerStore, model: str | None, sid: str) -> None:
    body = json.dumps({"prompt": "hi", "params": {}, **({"model": model} if model else {})})
    store.redis.hset(store.keys.meta(sid), mapping={"st": "queued", "tok": "x"})
    store.redis.xadd(store.keys.queue(model), {"sid": sid, "rid": "", "body": body})


def test_each_worker_takes_only_its_models_requests_and_acks_them_there(
    redis_server: EmbeddedRedis,
) -> None:
    prefix = f"q{secrets.token_hex(3)}:"
    both = WorkerStore(redis_server.url, "w-ab", prefix=prefix, models=["a", "b"])
    other = WorkerStore(redis_server.url, "w-c", prefix=prefix, models=["c"])
    plain = WorkerStore(redis_server.url, "w-none", prefix=prefix)  # names no model
    try:
        for store in (both, other, plain):
            store.ensure_group()
        assert both.queues == [f"{prefix}requests:a", f"{prefix}requests:b"]
        assert plain.queues == [f"{prefix}requests"]
        queue_request(both, "b", "s-b")
        queue_request(both, "a", "s-a")
        queue_request(both, None, "s-none")
        assert other.read_requests(8, None) == []
        taken = {r.stream_id: r for r in both.read_requests(8, None)}
        assert set(taken) == {"s-a", "s-b"}
        assert taken["s-b"].queue == f"{prefix}requests:b" and taken["s-b"].body is not None
        assert [r.stream_id for r in plain.read_requests(8, None)] == ["s-none"]
        both.ack([taken["s-a"].entry_id], taken["s-a"].queue)
        b = taken["s-b"]
        both.flush([Batch(b.stream_id, 0, [["k", "a"]], {}, 60.0, b.entry_id, b.queue)])
        for model in ("a", "b"):
            assert both.redis.xlen(both.keys.queue(model)) == 0
            assert both.redis.xpending(both.keys.queue(model), GROUP)["pending"] == 0
        both.follow(lambda: ["c"])  # a relay that learnt its upstream's list
        assert both.models == ["c"] and both.queues == [f"{prefix}requests:c"]
    finally:
        for store in (both, other, plain):
            store.close()
