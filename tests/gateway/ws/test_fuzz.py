"""Protocol fuzzing with hypothesis against a real gateway process and a real engine worker.

Thousands of WebSocket frames and HTTP bodies, most of them malformed, a few
valid (with a tiny ``max_tokens``: the fuzz gateway runs with
``--max-tokens-limit 16``). Every answer must be a typed error from the
protocol or a valid response; never a 500, an ``internal`` error, a crash or a
traceback in the gateway's log. Meanwhile a normal client streams greedy
completions on the same gateway and must get exactly the reference text.

TOKENRELAY_FUZZ_WS / TOKENRELAY_FUZZ_HTTP resize it (default 6000 + 4000 cases).
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from websockets.sync.client import ClientConnection, connect

from tests.gateway.procs import Proc, start_gateway, wait_ready
from tests.gateway.stack import Stack
from tokenrelay.gateway.session.protocol import ERROR_CODES

WS_CASES = int(os.environ.get("TOKENRELAY_FUZZ_WS", "7500"))  # frames
HTTP_CASES = int(os.environ.get("TOKENRELAY_FUZZ_HTTP", "3000"))  # requests
WS_MUTANTS = 4  # cheap derived cases per generated frame (truncations, flipped bytes...)
HTTP_MUTANTS = 2
FRAMES_PER_SOCKET = 90  # plus markers: under the per-socket burst of 200 frames
COUNTS: dict[str, int] = {"ws": 0, "http": 0}
SERVER_FRAMES = {"hello", "started", "token", "done", "resumed", "cancelled", "error", "pong"}
HTTP_STATUSES = {200, 204, 400, 401, 403, 404, 413, 429, 503}
BYSTANDER = {"prompt": "Count from one to twenty:", "params": {"max_tokens": 16,
             "temperature": 0, "ignore_eos": True}}  # fmt: skip


@pytest.fixture(scope="module")
def fuzz_gw(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Proc]]:
    logs = tmp_path_factory.mktemp("fuzz-logs")
    proc, addr = start_gateway(stack.redis.url, stack.prefix, logs, "--max-tokens-limit", "16")
    try:
        wait_ready(addr, proc, 60)
        yield addr, proc
    finally:
        proc.stop()
    text = proc.log_text()
    assert "Traceback" not in text, text[-3000:]


# --- strategies ------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)
small_ints = st.integers(min_value=-3, max_value=20)
weird = json_values | st.sampled_from(["", "x" * 300, -1, 2**70, True, [], {}])
roles = st.sampled_from(["user", "system", "assistant", "tool", "", 3])
messages = (
    st.lists(
        st.fixed_dictionaries({"role": roles, "content": st.text(max_size=30) | weird}),
        max_size=3,
    )
    | weird
)
params = (
    st.dictionaries(
        st.sampled_from(
            ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "bogus"]
        ),
        small_ints | st.floats(-1, 3, allow_nan=False) | weird,
        max_size=4,
    )
    | weird
)
SAFE_ID = r"[A-Za-z0-9._:-]{1,8}"  # request ids a generate accepts
ids = st.text(max_size=30) | st.sampled_from(["A" * 22, "not-a-stream-id-0000000", ""]) | weird


@st.composite
def ws_frames(draw: st.DrawFn) -> str | bytes:
    kind = draw(st.integers(0, 19))
    if kind == 0:
        return draw(st.text(max_size=60))
    if kind == 1:
        return draw(st.binary(max_size=40))
    if kind == 2:
        return json.dumps(draw(json_values))
    frame: dict[str, Any] = {
        "type": draw(
            st.sampled_from(
                ["generate", "generate", "resume", "cancel", "ping", "Generate", "", "hello"]
            )
            | weird
        )
    }
    for name, strat in (("request_id", ids), ("messages", messages), ("prompt", weird),
                        ("params", params), ("stream_id", ids), ("resume_token", ids),
                        ("after", small_ints | weird)):  # fmt: skip
        if draw(st.booleans()):
            frame[name] = draw(strat)
    if kind == 19:  # a valid generate, now and then
        frame = {"type": "generate", "request_id": draw(st.from_regex(SAFE_ID, fullmatch=True)),
                 "prompt": draw(st.text(min_size=1, max_size=20)),
                 "params": {"max_tokens": draw(st.integers(1, 3))}}  # fmt: skip
    return json.dumps(frame)


@st.composite
def http_cases(draw: st.DrawFn) -> tuple[str, str, bytes]:
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions",
                                 "/v1/streams/{sid}/cancel", "/v1/ws-token"]))  # fmt: skip
    kind = draw(st.integers(0, 6))
    if kind == 0:
        return "POST", path, draw(st.binary(max_size=60))
    if kind == 1:
        return "POST", path, json.dumps(draw(json_values)).encode()
    body: dict[str, Any] = {}
    for name, strat in (("model", st.sampled_from(["default", "gpt-4", ""]) | weird),
                        ("messages", messages), ("prompt", weird), ("max_tokens", small_ints),
                        ("temperature", weird), ("stream", st.booleans() | weird),
                        ("stop", weird), ("n", small_ints), ("resume_token", ids)):  # fmt: skip
        if draw(st.booleans()):
            body[name] = draw(strat)
    if "max_tokens" not in body or not isinstance(body["max_tokens"], int):
        # mostly invalid; the valid ones tiny (each is a real generation)
        body["max_tokens"] = draw(st.sampled_from([-1, 0, 10**9, "2", None, 1.5, [], 1]))
    return "POST", path, json.dumps(body).encode()


def mutants(data: str | bytes, rnd: random.Random, n: int) -> list[bytes]:
    """Mutation fuzzing on top of hypothesis: truncate, flip a byte, splice in a token."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    out = []
    for _ in range(n):
        if not raw:
            out.append(b"{")
            continue
        i = rnd.randrange(len(raw))
        op = rnd.randrange(3)
        if op == 0:
            out.append(raw[:i])
        elif op == 1:
            out.append(raw[:i] + bytes([rnd.randrange(256)]) + raw[i + 1 :])
        else:
            out.append(raw[:i] + rnd.choice(SPLICES) + raw[i:])
    return out


SPLICES = [b'"', b"}", b"]", b",", b"\\", b"null", b"-1e999", b"\xff", b'{"a":', b"[[[[", b"0"]


# --- the bystander -----------------------------------------------------------------


def run_stream(addr: str) -> tuple[list[int], str, dict[str, Any]]:
    with connect(f"ws://{addr}/v1/ws", open_timeout=10) as ws:
        json.loads(ws.recv(10))
        ws.send(json.dumps({"type": "generate", "request_id": "bystander", **BYSTANDER}))
        seqs, text = [], []
        while True:
            f = json.loads(ws.recv(120))
            if f["type"] == "token":
                seqs.append(f["seq"])
                text.append(f["text"])
            elif f["type"] == "done":
                return seqs, "".join(text), f
            elif f["type"] != "started":
                raise AssertionError(f)


class Bystander(threading.Thread):
    """Streams the reference prompt over and over while the fuzzer runs."""

    def __init__(self, addr: str, expected: str) -> None:
        super().__init__(daemon=True)
        self.addr, self.expected = addr, expected
        self.stop, self.runs, self.failures = threading.Event(), 0, []  # type: ignore[var-annotated]

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                seqs, text, done = run_stream(self.addr)
                ok = seqs == list(range(1, done["seq"])) and text == self.expected
                if not ok or done["finish_reason"] != "length":
                    self.failures.append((seqs, text, done))
                self.runs += 1
            except Exception as exc:
                self.failures.append(repr(exc))


# --- WebSocket ------------------------------------------------------------------------


MARKER_SID = "~fuzz-marker~"  # not a stream id: a cancel for it gets a not_found error back
MARKER = json.dumps({"type": "cancel", "stream_id": MARKER_SID})


class WsFuzzer:
    """One socket at a time; every case is followed by a marker frame.

    Frames are answered in order, so everything before the marker's
    ``not_found`` is the case's answer (or an earlier stream's frames).
    """

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.ws: ClientConnection | None = None
        self.sent = 0
        self.kinds: dict[str, int] = {}

    def socket(self) -> ClientConnection:
        if self.ws is None or self.sent >= FRAMES_PER_SOCKET:
            if self.ws is not None:
                self.ws.close()  # its tiny streams finish on their own
            self.ws = connect(f"ws://{self.addr}/v1/ws", open_timeout=10, max_size=None)
            self.ws.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            assert json.loads(self.ws.recv(10))["type"] == "hello"
            self.sent = 0
        return self.ws

    def check(self, f: dict[str, Any]) -> None:
        assert f.get("type") in SERVER_FRAMES, f
        if f["type"] == "error":
            assert f["code"] in ERROR_CODES and f["code"] != "internal", f
            assert isinstance(f["message"], str)
        key = f.get("code", f["type"])
        self.kinds[key] = self.kinds.get(key, 0) + 1

    def case(self, frames: list[str | bytes]) -> None:
        ws = self.socket()
        for frame in frames:
            ws.send(frame)
        ws.send(MARKER)
        self.sent += len(frames)
        while True:
            f = json.loads(ws.recv(30))
            if f.get("stream_id") == MARKER_SID and f.get("code") == "not_found":
                break
            self.check(f)
        COUNTS["ws"] += len(frames)

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()


def test_fuzz_websocket_frames(fuzz_gw: tuple[str, Proc]) -> None:
    addr, proc = fuzz_gw
    _, expected, _ = run_stream(addr)
    bystander = Bystander(addr, expected)
    bystander.start()
    fuzzer = WsFuzzer(addr)

    @settings(max_examples=WS_CASES // (1 + WS_MUTANTS), deadline=None, database=None,
              derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(ws_frames(), st.randoms(use_true_random=False))
    def fuzz(frame: str | bytes, rnd: random.Random) -> None:
        derived = [m.decode("utf-8", "replace") for m in mutants(frame, rnd, WS_MUTANTS)]
        fuzzer.case([frame, *derived])

    try:
        fuzz()
    finally:
        fuzzer.close()
        bystander.stop.set()
        bystander.join(180)
    assert proc.alive()
    assert COUNTS["ws"] >= WS_CASES * 0.6, COUNTS
    assert bystander.runs >= 1 and not bystander.failures, bystander.failures[:3]
    assert fuzzer.kinds.get("started", 0) > 0 and fuzzer.kinds.get("bad_request", 0) > 0
    print(f"ws fuzz: {COUNTS['ws']} cases, answers {sorted(fuzzer.kinds.items())}, "
          f"bystander streams {bystander.runs}")  # fmt: skip


# --- HTTP ------------------------------------------------------------------------------


def test_fuzz_http_bodies(fuzz_gw: tuple[str, Proc]) -> None:
    addr, proc = fuzz_gw
    statuses: dict[int, int] = {}
    nodelay = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    with httpx.Client(base_url=f"http://{addr}", timeout=60, transport=nodelay) as http:

        @settings(max_examples=HTTP_CASES // (1 + HTTP_MUTANTS), deadline=None, database=None,
                  derandomize=True, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(http_cases(), ids.filter(lambda s: isinstance(s, str) and "/" not in s),
               st.randoms(use_true_random=False))  # fmt: skip
        def fuzz(case: tuple[str, str, bytes], sid: str, rnd: random.Random) -> None:
            method, path, body = case
            path = path.replace("{sid}", quote(sid, safe="") or "x")
            for data in (body, *mutants(body, rnd, HTTP_MUTANTS)):
                one(method, path, data)

        def one(method: str, path: str, body: bytes) -> None:
            headers = {"content-type": "application/json"}
            r = http.request(method, path, content=body, headers=headers)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code in HTTP_STATUSES, (r.status_code, body, r.text[:300])
            if r.status_code >= 400:
                err = r.json()["error"]
                assert err["code"] in ERROR_CODES | {"model_not_found"}, err
                assert err["code"] != "internal", err
                if r.status_code in (429, 503):
                    assert int(r.headers["retry-after"]) >= 1
            elif r.headers.get("content-type", "").startswith("text/event-stream"):
                assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
            elif r.status_code == 200:
                assert isinstance(r.json(), dict)
            COUNTS["http"] += 1

        fuzz()
    assert proc.alive()
    assert COUNTS["http"] >= HTTP_CASES * 0.9, COUNTS
    assert httpx.get(f"http://{addr}/healthz").status_code == 200
    print(f"http fuzz: {COUNTS['http']} cases, statuses {sorted(statuses.items())}")
