"""Load-test token sources for bench/gateway.py (a benchmark tool, never a serving default).

Two sources push the same token frames at the same fixed rate:

* ``redis``: writes token events straight to Redis the way an engine worker
  does (:class:`worker.store.WorkerStore`, one pipelined round trip per
  tick for all streams, the Lua append of core/wire/scripts.py), so a real
  gateway process serves them to WebSocket clients. No model is involved.
* ``bare``: a bare ``websockets`` server (no Redis, no Starlette; on uvloop, as
  the gateway) that sends the same protocol-v1 frames to its clients directly:
  the ceiling.

Each token's text is ``t=<unix time>``, the moment its tick was handed over
(to Redis, or to the sockets), so a client can compute the latency added
between that moment and its receipt. Both run as child processes driven over
stdin/stdout by bench/gateway.py: they print one JSON line when ready, wait for
a ``go`` line, stream, and print one JSON line of stats.

    python -m bench.token_source redis --redis-url URL --streams N --rate R --events E [--groups G]
    python -m bench.token_source bare --streams N --rate R --events E [--groups G]

``--groups G`` splits the streams over G simulated engine workers whose steps
are evenly staggered over a tick (group g hands over g/G of a tick after group
0), as several unsynchronised workers feeding one gateway do; with the default
of 1, every stream advances in the same step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from typing import Any

from bench.common import load_generator_gc
from tokenrelay.core.wire.events import accepted_fields, done_fields, token_fields
from tokenrelay.core.wire.ids import hash_token, new_resume_token, new_stream_id
from tokenrelay.core.wire.keys import ACTIVE_TTL, HEARTBEAT_INTERVAL
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.gateway.server import loop_factory
from tokenrelay.worker.store import Batch, WorkerStore

SOURCE_ID = "bench-source"
BENCH_STATS = WorkerStats(worker_id=SOURCE_ID)  # what its heartbeat publishes


def stamp_text(t: float) -> str:
    return f"t={t:.6f}"


def parse_stamp(text: str) -> float:
    return float(text[2:])


def frame(obj: dict[str, Any]) -> str:
    """Compact JSON, as gateway/session/protocol.py encodes frames."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def wait_go() -> None:
    line = sys.stdin.readline()
    if line.strip() != "go":
        raise SystemExit(f"expected 'go', got {line!r}")


def create_streams(
    store: WorkerStore, n: int, *, stream_ttl: float, chunk: int = 500
) -> list[tuple[str, str]]:
    """``n`` running streams: the gateway's metadata, then the worker's seq-0 marker."""
    out: list[tuple[str, str]] = []
    for start in range(0, n, chunk):
        count = min(chunk, n - start)
        ids = [(new_stream_id(), new_resume_token()) for _ in range(count)]
        pipe = store.redis.pipeline(transaction=False)
        for sid, token in ids:
            meta = {
                "tok": hash_token(token),
                "st": "queued",
                "rid": "",
                "ts": str(int(time.time() * 1000)),
                "gw": "bench",
                "ttl": str(stream_ttl),
            }
            pipe.hset(store.keys.meta(sid), mapping=meta)  # type: ignore[arg-type]
            pipe.expire(store.keys.meta(sid), int(ACTIVE_TTL))
        pipe.execute()
        running = {"st": "running", "w": SOURCE_ID, "pt": "1"}
        batches = [Batch(sid, 0, [accepted_fields(1, SOURCE_ID)], dict(running)) for sid, _ in ids]
        for res in store.flush(batches):
            assert res.status == 1, res
        out.extend(ids)
    return out


def finish_streams(store: WorkerStore, sids: list[str], last_token: int, stream_ttl: float) -> None:
    done = done_fields("length", 1, last_token)
    batches = [Batch(sid, last_token + 1, [done], {"fr": "length"}, stream_ttl) for sid in sids]
    for res in store.flush(batches):
        assert res.status == 1, res


def backlog_stream(store: WorkerStore, events: int, stream_ttl: float) -> tuple[str, str]:
    """A finished stream with ``events`` token events (for the resume measurement)."""
    sid, token = create_streams(store, 1, stream_ttl=stream_ttl)[0]
    seq = 1
    while seq <= events:
        k = min(500, events - seq + 1)
        fields = [token_fields(stamp_text(time.time()))] * k
        assert store.flush([Batch(sid, seq, fields)])[0].status == 1
        seq += k
    finish_streams(store, [sid], events, stream_ttl)
    return sid, token


def pace(start: float, tick: int, rate: float) -> None:
    delay = start + tick / rate - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def split(items: list[Any], groups: int) -> list[list[Any]]:
    """``items`` in ``groups`` interleaved groups (a group per simulated engine worker)."""
    return [g for g in (items[i::groups] for i in range(groups)) if g]


def heartbeat(url: str, prefix: str, stop: threading.Event) -> None:
    """Keep the source's worker heartbeat alive (else gateways end its streams as orphaned)."""
    beat = WorkerStore(url, SOURCE_ID, prefix=prefix)
    try:
        while not stop.is_set():
            beat.heartbeat(BENCH_STATS)
            stop.wait(HEARTBEAT_INTERVAL)
    finally:
        beat.close()


def run_redis(args: argparse.Namespace) -> None:
    store = WorkerStore(args.redis_url, SOURCE_ID, prefix=args.prefix)
    store.heartbeat(BENCH_STATS)
    stop = threading.Event()
    beater = threading.Thread(target=heartbeat, args=(args.redis_url, args.prefix, stop))
    beater.start()
    try:
        stream_for(store, args)
    finally:
        stop.set()
        beater.join()
        store.close()


def stream_for(store: WorkerStore, args: argparse.Namespace) -> None:
    streams = create_streams(store, args.streams, stream_ttl=args.stream_ttl)
    emit({"streams": streams, "pid": os.getpid()})
    wait_go()
    sids = [sid for sid, _ in streams]
    groups = split(sids, args.groups)
    flush_ms: list[float] = []
    with load_generator_gc():  # a simulated worker: the load, not the system under test
        start = time.monotonic()
        tick_all(store, groups, args, start, flush_ms)
    finish_streams(store, sids, args.events, args.stream_ttl)
    emit({"ticks": args.events, "wall_s": time.monotonic() - start, "flush_ms": flush_ms})


def tick_all(
    store: WorkerStore,
    groups: list[list[str]],
    args: argparse.Namespace,
    start: float,
    flush_ms: list[float],
) -> None:
    """Append one token event to every stream per tick, group by group, at ``args.rate``."""
    for seq in range(1, args.events + 1):
        for g, group in enumerate(groups):
            # group g is a worker whose steps end g/len(groups) of a tick after group 0's
            pace(start, (seq - 1) * len(groups) + g, args.rate * len(groups))
            t = time.time()  # the worker's step ends: its events go to Redis now
            fields = [token_fields(stamp_text(t))]
            res = store.flush([Batch(sid, seq, fields) for sid in group])
            flush_ms.append((time.time() - t) * 1000)
            bad = [(sid, r) for sid, r in zip(group, res, strict=True) if r.status != 1]
            if bad:
                raise SystemExit(f"append failed at seq {seq} for {len(bad)} streams: {bad[:3]}")


async def run_bare(args: argparse.Namespace) -> None:
    from websockets.asyncio.server import ServerConnection, serve

    conns: dict[str, ServerConnection] = {}
    all_in = asyncio.Event()
    finished = asyncio.Event()

    async def handler(ws: ServerConnection) -> None:
        await ws.send(frame({"type": "hello", "protocol": 1, "heartbeat_s": 20.0}))
        req = json.loads(await ws.recv())
        sid = req["stream_id"]
        await ws.send(frame({"type": "resumed", "stream_id": sid, "after": req.get("after", 0)}))
        conns[sid] = ws
        if len(conns) >= args.streams:
            all_in.set()
        await finished.wait()
        await ws.wait_closed()

    async with serve(
        handler,
        "127.0.0.1",
        0,
        max_size=1 << 20,
        compression=None,
        ping_interval=20,
        ping_timeout=20,
        backlog=2048,
    ) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        emit({"port": port, "pid": os.getpid()})
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, wait_go)
        await asyncio.wait_for(all_in.wait(), 30)
        pairs = list(conns.items())
        groups = split(pairs, args.groups)
        flush_ms: list[float] = []
        start = time.monotonic()
        for seq in range(1, args.events + 1):
            for g, group in enumerate(groups):
                slot = (seq - 1) * len(groups) + g
                delay = start + slot / (args.rate * len(groups)) - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                t = time.time()
                text = stamp_text(t)
                for sid, ws in group:
                    msg = frame({"type": "token", "stream_id": sid, "seq": seq, "text": text})
                    await ws.send(msg)
                flush_ms.append((time.time() - t) * 1000)
        for sid, ws in pairs:
            done = {
                "type": "done",
                "stream_id": sid,
                "seq": args.events + 1,
                "finish_reason": "length",
                "usage": {"prompt_tokens": 1, "completion_tokens": args.events},
            }
            await ws.send(frame(done))
        wall = time.monotonic() - start
        finished.set()
        emit({"ticks": args.events, "wall_s": wall, "flush_ms": flush_ms})
        # the clients close their sockets once they have the done frame
        await asyncio.wait_for(
            asyncio.gather(*(ws.wait_closed() for _, ws in pairs)), args.events / args.rate + 60
        )


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.token_source", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("mode", choices=["redis", "bare"])
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--prefix", default="bench:")
    ap.add_argument("--streams", type=int, required=True)
    ap.add_argument("--rate", type=float, default=20.0, help="tokens per second per stream")
    ap.add_argument("--events", type=int, required=True, help="token events per stream")
    ap.add_argument("--stream-ttl", type=float, default=600.0)
    ap.add_argument(
        "--groups",
        type=int,
        default=1,
        help="streams split over this many simulated workers, their steps evenly staggered",
    )
    args = ap.parse_args()
    if args.groups < 1:
        ap.error("--groups must be at least 1")
    if args.mode == "redis":
        if not args.redis_url:
            ap.error("redis mode needs --redis-url")
        run_redis(args)
    else:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:  # uvloop, as the gateway
            runner.run(run_bare(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
