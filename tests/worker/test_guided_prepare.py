"""A worker in this process, on the session's engine and Redis: where guided grammars compile.

The ``n`` choices of a request are streams of their own with the same ``response_format``:
the worker compiles that grammar once for all of them, on the preparer's thread, never on
the loop that steps the engine (a large schema compiles for seconds: every running stream
would wait meanwhile).
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.events import Event
from tokenrelay.engine.guided import compiler as compiler_module
from tokenrelay.engine.guided import matcher as matcher_module
from tokenrelay.gateway.streams.store import StreamStore
from tokenrelay.worker.main import Heartbeat, Worker
from tokenrelay.worker.store import WorkerStore

PREFIX = "wguided:"
LOOP = "test-worker-loop"  # the thread that runs the worker's loop (and steps the engine)


@pytest.fixture
def worker(llm_engine: Any, redis_server: EmbeddedRedis) -> Iterator[Worker]:
    worker_store = WorkerStore(redis_server.url, "guided-test-worker", prefix=PREFIX)
    worker = Worker(llm_engine, worker_store, detach_timeout=30, stream_ttl=60)
    worker._publish_stats()
    Heartbeat(worker, redis_server.url, PREFIX).start()
    thread = threading.Thread(target=worker.run, name=LOOP)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(30)
        while llm_engine.has_unfinished():
            llm_engine.step()
        worker_store.close()


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """The threads grammars were built on ("build") and matchers started on ("start")."""
    seen: dict[str, list[str]] = {"build": [], "start": []}
    real_build = compiler_module.GrammarCompiler._build
    real_init = matcher_module.GuidedMatcher.__init__

    def build(self: Any, fmt: Any) -> str:
        seen["build"].append(threading.current_thread().name)
        return real_build(self, fmt)

    def start(self: Any, tok: Any, grammar: Any, *, _matcher: Any = None) -> None:
        if _matcher is None:  # a copy (fork) takes no llguidance build
            seen["start"].append(threading.current_thread().name)
        real_init(self, tok, grammar, _matcher=_matcher)

    monkeypatch.setattr(compiler_module.GrammarCompiler, "_build", build)
    monkeypatch.setattr(matcher_module.GuidedMatcher, "__init__", start)
    return seen


async def _run_choices(url: str, body: dict[str, Any], n: int) -> list[list[Event]]:
    store = StreamStore(url, prefix=PREFIX, stream_ttl=60)
    await store.start()
    try:
        for _ in range(100):  # the heartbeat thread registers the worker
            if await store.live_workers(max_age=0):
                break
            await asyncio.sleep(0.05)
        sids = [(await store.create(body, f"guided-{i}", attach=False)).stream_id
                for i in range(n)]  # fmt: skip

        async def events(sid: str) -> list[Event]:
            return [ev async for ev in store.tail(sid, -1)]

        return await asyncio.gather(*(events(s) for s in sids))
    finally:
        await store.close()


def test_n_choices_compile_their_grammar_once_off_the_step_loop(
    worker: Worker, redis_server: EmbeddedRedis, compiles: dict[str, list[str]]
) -> None:
    schema = {  # a schema no other test compiled (the engine is the session's)
        "type": "object",
        "properties": {f"k_{uuid.uuid4().hex[:8]}": {"type": "integer"}},
        "required": [],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    params = {"max_tokens": 12, "temperature": 0, "response_format": fmt}
    body = {"prompt": "Answer in JSON.", "params": params}
    results = asyncio.run(_run_choices(redis_server.url, body, 3))
    for events in results:
        assert events[0].kind == "accepted", events
        assert events[-1].kind == "done" and events[-1].finish_reason in ("stop", "length")
        text = "".join(e.text or "" for e in events if e.kind == "token")
        if events[-1].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
    assert compiles["build"] == ["tokenizer"]  # once for the three, on the preparer's thread
    assert compiles["start"] == ["tokenizer"]  # one llguidance matcher; the choices copy it
