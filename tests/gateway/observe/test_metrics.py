"""``/metrics`` and the logs across a generate / cancel / resume scenario (real processes)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.procs import Client, generate_frame
from tests.gateway.stack import Stack

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(addr: str) -> Samples:
    resp = httpx.get(f"http://{addr}/metrics", timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for fam in text_string_to_metric_families(resp.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


async def until_done(c: Client, sid: str) -> list[dict[str, Any]]:
    frames = await c.recv_until(lambda f: f.get("stream_id") == sid and f["type"] == "done", 90)
    return [f for f in frames if f.get("stream_id") == sid]


async def started(c: Client, rid: str) -> dict[str, Any]:
    frames = await c.recv_until(lambda f: f.get("request_id") == rid, 60)
    assert frames[-1]["type"] == "started", frames[-1]
    return frames[-1]


async def test_metrics_and_logs_follow_generate_cancel_resume(stack: Stack) -> None:
    wid = stack.worker_id
    before = scrape(stack.a)
    ids: dict[str, str] = {}
    c = await Client.open(stack.a)
    try:
        # a plain stream, and a bad frame (an error by code)
        await c.send(generate_frame("Name a colour.", "m-gen", max_tokens=3, temperature=0))
        ids["m-gen"] = (await started(c, "m-gen"))["stream_id"]
        done = (await until_done(c, ids["m-gen"]))[-1]
        assert done["finish_reason"] in ("stop", "length")
        await c.send({"type": "resume"})
        assert (await c.recv())["code"] == "bad_request"
        # a cancelled stream
        long = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
        await c.send(generate_frame("Count to a thousand.", "m-cancel", **long))
        ids["m-cancel"] = sid = (await started(c, "m-cancel"))["stream_id"]
        await c.recv_until(lambda f: f.get("stream_id") == sid and f["type"] == "token", 60)
        during = scrape(stack.a)
        assert value(during, "tokenrelay_websocket_connections") >= 1
        assert value(during, "tokenrelay_gateway_streams_attached") >= 1
        await c.send({"type": "cancel", "stream_id": sid})
        assert (await until_done(c, sid))[-1]["finish_reason"] == "cancelled"
        # a stream whose client drops, then resumes
        await c.send(generate_frame("Describe the sea.", "m-resume", max_tokens=10,
                                    temperature=0, ignore_eos=True))  # fmt: skip
        first = await started(c, "m-resume")
        ids["m-resume"] = sid = first["stream_id"]
        await c.recv_until(lambda f: f.get("stream_id") == sid and f.get("seq") == 2, 60)
    finally:
        c.cut()
    r = await Client.open(stack.a)
    try:
        await r.send({"type": "resume", "stream_id": sid, "resume_token": first["resume_token"],
                      "after": 1})  # fmt: skip
        frames = await until_done(r, sid)
        assert frames[0]["type"] == "resumed" and frames[1]["seq"] == 2  # seq 2 is replayed
        assert frames[-1]["finish_reason"] == "length"
    finally:
        await r.close()
    bad = httpx.post(f"http://{stack.a}/v1/chat/completions", content=b"{", timeout=10)
    assert bad.status_code == 400

    # the workers publish their stats once a second
    deadline = time.monotonic() + 10
    while True:
        after = scrape(stack.a)
        fin = "tokenrelay_requests_finished_total"
        moved = (
            value(after, fin, worker_id=wid, finish_reason="cancelled")
            > value(before, fin, worker_id=wid, finish_reason="cancelled")
            and value(after, "tokenrelay_request_duration_seconds_count")
            >= value(before, "tokenrelay_request_duration_seconds_count") + 3
        )
        if moved or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.3)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta(fin, worker_id=wid, finish_reason="cancelled") >= 1
    finished = sum(delta(fin, worker_id=wid, finish_reason=r) for r in ("stop", "length"))
    assert finished >= 2
    assert delta("tokenrelay_requests_started_total", worker_id=wid) >= 3
    assert delta("tokenrelay_generated_tokens_total", worker_id=wid) >= 12
    for hist in ("time_to_first_token", "request_duration", "queue_wait"):
        assert delta(f"tokenrelay_{hist}_seconds_count", backend="engine") >= 3, hist
    assert delta("tokenrelay_time_per_output_token_seconds_count", backend="engine") >= 2
    # one observation per gap between token events (3 tokens: 2 gaps, and more)
    assert delta("tokenrelay_inter_token_latency_seconds_count", backend="engine") >= 2
    # live events handed to the sockets (the tails above), one per append batch
    assert delta("tokenrelay_delivery_latency_seconds_count") >= 1
    assert ("tokenrelay_delivery_latency_seconds_bucket", (("le", "0.001"),)) in after
    assert value(after, "tokenrelay_time_to_first_token_seconds_sum", backend="engine") > 0
    assert value(after, "tokenrelay_worker_info", worker_id=wid, backend="engine") == 1
    assert value(after, "tokenrelay_worker_models", worker_id=wid, model="default") == 1
    assert delta("tokenrelay_resumes_total") == 1
    assert delta("tokenrelay_resume_events_replayed_total") >= 1
    assert delta("tokenrelay_cancel_requests_total") == 1
    assert delta("tokenrelay_disconnects_total") >= 1
    assert delta("tokenrelay_errors_total", code="bad_request", transport="ws") == 1
    assert delta("tokenrelay_errors_total", code="bad_request", transport="http") == 1
    assert value(after, "tokenrelay_kv_blocks_total", worker_id=wid) > 0
    assert value(after, "tokenrelay_kv_blocks_free", worker_id=wid) > 0
    assert ("tokenrelay_prefix_cache_hit_rate", (("worker_id", wid),)) in after
    assert ("tokenrelay_sequences_running", (("worker_id", wid),)) in after
    assert ("tokenrelay_queue_depth", ()) in after
    assert value(after, "tokenrelay_redis_up") == 1 and value(after, "tokenrelay_workers") >= 1

    # every log line about these requests carries both ids; one summary per stream
    sids = set(ids.values())
    deadline = time.monotonic() + 10
    while True:
        lines = json_lines(stack.worker.log_text() + stack.gw_a.log_text())
        mine = [ln for ln in lines if ln.get("stream_id") in sids or ln.get("request_id") in ids]
        summaries = [ln for ln in mine if ln["msg"] == "stream summary"]
        if len(summaries) >= 3 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.3)
    assert mine
    for line in mine:
        assert line.get("request_id") in ids and line.get("stream_id") == ids[line["request_id"]]
    by_rid = {ln["request_id"]: ln for ln in summaries}
    assert len(summaries) == 3 and set(by_rid) == set(ids), summaries
    assert by_rid["m-cancel"]["finish_reason"] == "cancelled"
    resumed = by_rid["m-resume"]
    assert resumed["finish_reason"] == "length" and resumed["completion_tokens"] == 10
    assert resumed["resumes"] == 1 and resumed["disconnects"] >= 1
    assert resumed["ttft_s"] > 0 and resumed["tpot_s"] > 0 and resumed["e2e_s"] > 0
    assert resumed["prompt_tokens"] > 0 and resumed["ended_by"] == wid
    assert by_rid["m-gen"]["resumes"] == 0 and by_rid["m-gen"]["disconnects"] == 0
