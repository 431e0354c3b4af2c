"""Hostile requests beside a bystander: one client must not hurt the others (issue 37).

Starts ``tokenrelay serve`` (default model, CPU, its own data dir and port,
``HF_HUB_OFFLINE=1``). A monitor, in a process of its own so that the hostile
clients' work in this one cannot delay what it measures, keeps a victim greedy
WebSocket stream running (a new one starts as soon as one ends, on the same socket)
and polls ``/healthz`` every ``--poll`` seconds. Beside it, one case at a time, a
hostile client sends:

* quiet          nothing: the baseline of the same run;
* tools-uri      three tools of 1000 ``"format": "uri"`` properties each (chat);
* schema-over    a ``response_format`` schema of 1000 ``pattern`` properties (chat);
* schema-edge    a ``response_format`` schema of 126 ``"format": "uri"`` properties,
                 the budget's 128 keywords less two: admitted, so the gateway checks it
                 (its schema pool) and the worker compiles its grammar (its preparer);
* entries        a non-streaming ``n=16, max_tokens=8192, top_logprobs=20`` chat;
* tool-spaces    a call of a named tool whose string argument ``logit_bias`` (+100 on
                 the vocabulary's longest run of spaces) fills for ``--space-tokens``
                 tokens: the worker reads ~80K spaces after a ``<tool_call>`` as they
                 stream, as the call's arguments (``length``); after the cases, the block
                 pattern the worker used before the fix (commit 33001cb) and today's call
                 reader (core/wire/tool_stream.py) are timed on that text;
* sse-resumes    ``--resumes`` concurrent SSE resumes of one live stream, each with the
                 stream's resume token (the hostile client started the stream itself);
* ws-resumes     ``--resumes`` WebSocket sockets each resuming that stream at once;
* ws-resume-loop one socket sending ``--resumes`` resumes of that stream back to back;
* long-prompt    three tools of 42 ``"format": "uri"`` properties each, admitted (126
                 keywords) and shown to the model: a prompt of 2,300 tokens, prefilled
                 beside the victim's decodes (256 prompt tokens a step on CPU, the
                 engine's --max-prefill-while-decoding) as any prompt that long is.

The relay's caps (upstream event sizes, deadlines: issue 37 item 6) need an
upstream server and are not here (tests/worker/upstream/ covers them). All the
clients are on loopback, which the per-address limits exempt (docs/api.md): what
holds a flood here is the per-request and per-stream caps alone.

For each case: what the hostile client got (status and error code, time to its
answer), the worst ``/healthz`` latency during the case (target: under 1 s) and the
worst gap between two of the victim's token frames during the case, the restart of
a finished victim stream included (target: under 2 s). A case lasts from the first
hostile request to ``--settle`` seconds after its last answer. Exits 1 when a target
is missed or a hostile client got another answer than the documented one.

    .venv/bin/python -m bench.abuse                 # prints the table
    .venv/bin/python -m bench.abuse --resumes 50 --space-tokens 256
    .venv/bin/python -m bench.abuse --cases quiet,long-prompt
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import httpx

from bench.common import load_average, machine, result_path, say, write_result
from tests.gateway.procs import Client, Proc, free_port, generate_frame, wait_ready

HEALTH_TARGET = 1.0  # s: the worst /healthz latency during a case
GAP_TARGET = 2.0  # s: the worst gap between two victim token frames during a case
VICTIM_PROMPT = "Tell me a long story about a lighthouse keeper."
SPACE_MARKS = frozenset(" \u0120\u2581")  # a space as byte-level BPE and SentencePiece spell it
# what core/wire/tools.py matched call blocks with before commit 33001cb
OLD_BLOCK_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


# --- pure parts (tests/bench/test_abuse.py) ------------------------------------------


def worst_gap(times: Sequence[float], start: float, end: float) -> float:
    """The longest wait for a victim token frame during ``[start, end]``.

    ``times``: every token frame's arrival, in order. A gap counts when it overlaps
    the window, whole (a stall that began before the case or ended after it is the
    stall clients saw); one still open at ``end`` (no frame after it) counts up to
    ``end``. No frame at all: 0.
    """
    worst = 0.0
    for a, b in itertools.pairwise(times):
        if b > start and a < end:
            worst = max(worst, b - a)
    if times and times[-1] < end:
        worst = max(worst, end - times[-1])
    return worst


def worst_latency(polls: Iterable[tuple[float, float, bool]], start: float, end: float) -> float:
    """The longest ``/healthz`` poll ``(sent, answered, ok)`` that overlaps ``[start, end]``."""
    return max((b - a for a, b, _ in polls if a < end and b > start), default=0.0)


def failed_polls(polls: Iterable[tuple[float, float, bool]], start: float, end: float) -> int:
    """Polls overlapping ``[start, end]`` that got no 200."""
    return sum(1 for a, b, ok in polls if a < end and b > start and not ok)


def longest_space_token(vocab: Mapping[str, int] | Sequence[Any]) -> tuple[int, int]:
    """``(token id, spaces)`` of the vocabulary's longest token made of spaces alone.

    ``vocab``: a tokenizer.json model's ``vocab``, a BPE mapping of piece -> id or a
    Unigram list of ``[piece, score]`` (the id is the index). Spaces are ``" "``,
    byte-level BPE's ``"Ġ"`` or SentencePiece's ``"▁"``; ties go to the lower id.
    Raises ``ValueError`` when there is none.
    """
    pieces = (
        vocab.items()
        if isinstance(vocab, Mapping)
        else ((entry[0], i) for i, entry in enumerate(vocab))
    )
    best: tuple[int, int] | None = None
    for piece, tid in pieces:
        longer = best is None or (len(piece), -tid) > (best[1], -best[0])
        if piece and set(piece) <= SPACE_MARKS and longer:
            best = (int(tid), len(piece))
    if best is None:
        raise ValueError("no token of spaces alone in the vocabulary")
    return best


def error_code(body: Any) -> str:
    """The ``code`` of an OpenAI-style error body (``{"error": {"code"}}``), or ""."""
    err = body.get("error") if isinstance(body, dict) else None
    return str(err.get("code") or "") if isinstance(err, dict) else ""


def tally(answers: Iterable[str]) -> str:
    """``"4 x 200, 196 x 503 overloaded"``: each distinct answer and its count, most first."""
    counts = Counter(answers)
    return ", ".join(f"{n} x {a}" for a, n in sorted(counts.items(), key=lambda x: (-x[1], x[0])))


# --- the monitor: victim stream and /healthz, in a process of its own -----------------


@dataclass
class Watched:
    """What the monitor saw, on the system's monotonic clock (shared by processes)."""

    tokens: list[float] = field(default_factory=list)  # victim token frame arrivals
    polls: list[tuple[float, float, bool]] = field(default_factory=list)  # /healthz
    streams: int = 0  # victim streams finished
    ends: Counter[str] = field(default_factory=Counter)  # finish_reason (or error code)


async def _poll(addr: str, every: float, stop: MpEvent, w: Watched) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                ok = (await http.get(f"http://{addr}/healthz")).status_code == 200
            except httpx.HTTPError:
                ok = False
            answered = time.monotonic()
            w.polls.append((sent, answered, ok))
            await asyncio.sleep(max(0.0, every - (answered - sent)))


async def _victim(addr: str, tokens: int, stop: MpEvent, w: Watched) -> None:
    c: Client | None = None
    while not stop.is_set():
        try:
            if c is None:
                c = await Client.open(addr)
            frame = generate_frame(VICTIM_PROMPT, f"victim-{w.streams}", max_tokens=tokens,
                                   temperature=0, ignore_eos=True)  # fmt: skip
            await c.send(frame)
            while not stop.is_set():
                f = await c.recv(60)
                if f["type"] == "token":
                    w.tokens.append(time.monotonic())
                elif f["type"] == "done":
                    w.streams += 1
                    w.ends[str(f.get("finish_reason"))] += 1
                    break
                elif f["type"] == "error":
                    w.ends[f"error {f.get('code')}"] += 1
                    await asyncio.sleep(0.2)
                    break
        except Exception as exc:  # the socket broke or timed out: a new one
            w.ends[f"broken ({type(exc).__name__})"] += 1
            if c is not None:
                with contextlib.suppress(Exception):
                    await c.close()
            c = None
            await asyncio.sleep(0.2)
    if c is not None:
        with contextlib.suppress(Exception):
            await c.close()


async def _monitor(addr: str, tokens: int, every: float, stop: MpEvent, conn: Connection) -> None:
    w = Watched()
    tasks = [
        asyncio.create_task(_poll(addr, every, stop, w)),
        asyncio.create_task(_victim(addr, tokens, stop, w)),
    ]
    while not w.tokens:  # ready once the victim streams
        if stop.is_set() or all(t.done() for t in tasks):
            break
        await asyncio.sleep(0.05)
    conn.send("ready")
    while not stop.is_set():
        await asyncio.sleep(0.05)
    await asyncio.wait(tasks, timeout=5)
    for t in tasks:
        t.cancel()
    conn.send({"tokens": w.tokens, "polls": w.polls, "streams": w.streams, "ends": dict(w.ends)})


def monitor_main(addr: str, tokens: int, every: float, stop: MpEvent, conn: Connection) -> None:
    """The monitor process: victim and /healthz until ``stop``, then what it saw on ``conn``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C: the parent stops it
    asyncio.run(_monitor(addr, tokens, every, stop, conn))


# --- the hostile clients --------------------------------------------------------------


@dataclass
class Got:
    """What one case's hostile client got."""

    answer: str  # e.g. "400 bad_request", or a tally
    seconds: float  # to its (slowest) answer
    expected: bool  # the documented answer
    text: str = ""  # tool-spaces: the completion it got back


@dataclass
class Case:
    name: str
    sends: str  # what the hostile client sends, for the table
    run: Callable[[], Awaitable[Got]]
    got: Got | None = None
    start: float = 0.0
    end: float = 0.0


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "default", "messages": [{"role": "user", "content": "Hi."}], **fields}


def uri_tools(tools: int, properties: int) -> list[dict[str, Any]]:
    """``tools`` function tools, each of ``properties`` string properties with ``format: uri``."""
    props = {f"p{i}": {"type": "string", "format": "uri"} for i in range(properties)}
    return [
        {"type": "function",
         "function": {"name": f"t{j}", "parameters": {"type": "object", "properties": props}}}
        for j in range(tools)
    ]  # fmt: skip


def pattern_schema(properties: int) -> dict[str, Any]:
    props = {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{1,{8 + i % 24}}}@[a-z]+\\.com$"}
             for i in range(properties)}  # fmt: skip
    schema = {"type": "object", "properties": props}
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


class Hostile:
    """The hostile client's requests, against one serve at ``addr``."""

    def __init__(self, addr: str, http: httpx.AsyncClient, resumes: int, space: tuple[int, int],
                 space_tokens: int) -> None:  # fmt: skip
        self.addr, self.http = addr, http
        self.base = f"http://{addr}"
        self.resumes = resumes
        self.space, self.space_tokens = space, space_tokens
        self.sid = self.token = ""  # the stream the resume floods read
        self._own: httpx.Response | None = None
        self._drain: asyncio.Task[None] | None = None

    async def post(self, body: dict[str, Any]) -> tuple[int, Any, float]:
        t = time.monotonic()
        r = await self.http.post(f"{self.base}/v1/chat/completions", json=body)
        return r.status_code, r.json(), time.monotonic() - t

    async def refused(self, body: dict[str, Any], status: int, code: str) -> Got:
        got_status, got, dt = await self.post(body)
        c = error_code(got)
        return Got(f"{got_status} {c}".strip(), dt, (got_status, c) == (status, code))

    async def quiet(self) -> Got:
        await asyncio.sleep(5.0)
        return Got("-", 0.0, True)

    async def tools_uri(self) -> Got:
        return await self.refused(chat(tools=uri_tools(3, 1000), max_tokens=8), 400, "bad_request")

    async def schema_over(self) -> Got:
        body = chat(response_format=pattern_schema(1000), max_tokens=8)
        return await self.refused(body, 400, "bad_request")

    async def schema_edge(self) -> Got:
        props = {f"p{i}": {"type": "string", "format": "uri"} for i in range(126)}
        schema = {"type": "object", "properties": props, "required": ["p0"]}
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        status, got, dt = await self.post(chat(response_format=fmt, max_tokens=16, temperature=0))
        if status != 200:
            return Got(f"{status} {error_code(got)}", dt, False)
        reason = got["choices"][0]["finish_reason"]
        return Got(f"200, `{reason}`", dt, reason in ("stop", "length"))

    async def long_prompt(self) -> Got:
        body = chat(tools=uri_tools(3, 42), max_tokens=1, temperature=0)
        status, got, dt = await self.post(body)
        if status != 200:
            return Got(f"{status} {error_code(got)}", dt, False)
        prompt = got["usage"]["prompt_tokens"]
        return Got(f"200, a {prompt:,}-token prompt", dt, True)

    async def entries(self) -> Got:
        body = chat(n=16, max_tokens=8192, logprobs=True, top_logprobs=20)
        return await self.refused(body, 413, "too_large")

    async def tool_spaces(self) -> Got:
        params = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
        tool = {"type": "function", "function": {"name": "f", "parameters": params}}
        body = chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}},
                    logit_bias={str(self.space[0]): 100}, max_tokens=self.space_tokens,
                    temperature=0, stream=True)  # fmt: skip
        t = time.monotonic()
        arguments, finish, status = "", None, 0
        async with self.http.stream("POST", f"{self.base}/v1/chat/completions", json=body) as r:
            status = r.status_code
            async for line in r.aiter_lines():  # the call's arguments stream as they come
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or ():
                    finish = choice.get("finish_reason") or finish
                    for call in choice["delta"].get("tool_calls") or ():
                        arguments += call["function"].get("arguments", "")
        dt = time.monotonic() - t
        if status != 200:
            return Got(f"{status}", dt, False)
        spaces = arguments.count(" ")
        answer = f"200, `{finish}`, {spaces:,} spaces streamed as the call's arguments"
        # the text the worker read: the call's markup, then the arguments so far
        text = '<tool_call>\n{"name": "f", "arguments": ' + arguments
        return Got(answer, dt, finish == "length" and spaces > 0, text)

    async def start_stream(self, tokens: int) -> None:
        """The stream the resume floods read: started (and read) by the hostile client."""
        body = chat(stream=True, max_tokens=tokens, temperature=0, ignore_eos=True)
        req = self.http.build_request("POST", f"{self.base}/v1/chat/completions", json=body)
        self._own = await self.http.send(req, stream=True)
        self.sid = self._own.headers["x-stream-id"]
        self.token = self._own.headers["x-resume-token"]

        async def drain(r: httpx.Response) -> None:
            with contextlib.suppress(httpx.HTTPError):
                async for _ in r.aiter_bytes():
                    pass

        self._drain = asyncio.create_task(drain(self._own))

    async def stop_stream(self) -> None:
        if self.sid:
            with contextlib.suppress(httpx.HTTPError):
                await self.http.post(f"{self.base}/v1/streams/{self.sid}/cancel",
                                     headers={"X-Resume-Token": self.token})  # fmt: skip
        if self._drain is not None:
            self._drain.cancel()
        if self._own is not None:
            await self._own.aclose()

    async def sse_resumes(self) -> Got:
        url = f"{self.base}/v1/streams/{self.sid}/events"

        async def one() -> tuple[str, float, httpx.Response | None]:
            t = time.monotonic()
            req = self.http.build_request("GET", url, headers={"X-Resume-Token": self.token})
            try:
                r = await self.http.send(req, stream=True)
            except httpx.HTTPError as exc:
                return type(exc).__name__, time.monotonic() - t, None
            dt = time.monotonic() - t
            if r.status_code == 200:
                return "200", dt, r
            try:
                code = error_code(json.loads(await r.aread()))
            except ValueError:
                code = ""
            await r.aclose()
            return f"{r.status_code} {code}".strip(), dt, None

        results = await asyncio.gather(*(one() for _ in range(self.resumes)))
        served = [r for _, _, r in results if r is not None]
        await asyncio.sleep(1.0)  # the served ones read on a while
        for r in served:
            await r.aclose()
        answers = [a for a, _, _ in results]
        ok = set(answers) <= {"200", "503 overloaded"} and "503 overloaded" in answers
        return Got(tally(answers), max(dt for _, dt, _ in results), ok)

    def resume_frame(self) -> dict[str, Any]:
        return {"type": "resume", "stream_id": self.sid, "resume_token": self.token, "after": 0}

    async def ws_resumes(self) -> Got:
        sockets = await asyncio.gather(*(Client.open(self.addr) for _ in range(self.resumes)))

        async def one(c: Client) -> tuple[str, float]:
            t = time.monotonic()
            await c.send(self.resume_frame())
            while True:
                f = await c.recv(60)
                if f["type"] == "resumed":
                    return "resumed", time.monotonic() - t
                if f["type"] == "error":
                    return f"error {f.get('code')}", time.monotonic() - t

        try:
            results = await asyncio.gather(*(one(c) for c in sockets))
            await asyncio.sleep(1.0)
        finally:
            await asyncio.gather(*(c.close() for c in sockets), return_exceptions=True)
        answers = [a for a, _ in results]
        ok = set(answers) <= {"resumed", "error overloaded"} and "error overloaded" in answers
        return Got(tally(answers), max(dt for _, dt in results), ok)

    async def ws_resume_loop(self) -> Got:
        c = await Client.open(self.addr)
        t = time.monotonic()
        try:
            for _ in range(self.resumes):
                await c.send(self.resume_frame())
            answers: list[str] = []
            while len(answers) < self.resumes:
                f = await c.recv(60)
                if f["type"] == "resumed":
                    answers.append("resumed")
                elif f["type"] == "error":
                    answers.append(f"error {f.get('code')}")
            dt = time.monotonic() - t
        finally:
            await c.close()
        return Got(tally(answers), dt, set(answers) == {"resumed"})


FLOODS = ("sse-resumes", "ws-resumes", "ws-resume-loop")  # read the hostile client's stream
DEFAULT_CASES = ("quiet", "tools-uri", "schema-over", "schema-edge", "entries", "tool-spaces",
                 *FLOODS, "long-prompt")  # fmt: skip


def cases(h: Hostile, resumes: int, space_tokens: int) -> list[Case]:
    """Every case, in the order they run."""
    spaces = h.space[1] * space_tokens
    return [
        Case("quiet", "nothing (the baseline)", h.quiet),
        Case("tools-uri", "3 tools of 1000 `\"format\": \"uri\"` properties each", h.tools_uri),
        Case("schema-over", "`response_format` schema of 1000 `pattern` properties",
             h.schema_over),
        Case("schema-edge", "`response_format` schema of 126 `format: uri` properties (the "
             "budget: 128)", h.schema_edge),
        Case("entries", "non-streaming `n=16, max_tokens=8192, top_logprobs=20`", h.entries),
        Case("tool-spaces", f"a tool call whose argument `logit_bias` fills with {spaces:,} "
             f"spaces ({space_tokens} tokens)", h.tool_spaces),
        Case("sse-resumes", f"{resumes} concurrent SSE resumes of one live stream",
             h.sse_resumes),
        Case("ws-resumes", f"{resumes} WebSocket sockets resume that stream at once",
             h.ws_resumes),
        Case("ws-resume-loop", f"one socket sends {resumes} resumes of that stream",
             h.ws_resume_loop),
        Case("long-prompt", "3 tools of 42 `format: uri` properties each (126 keywords), "
             "shown to the model", h.long_prompt),
    ]  # fmt: skip


# --- the run ---------------------------------------------------------------------------


@dataclass
class Run:
    cases: list[Case] = field(default_factory=list)
    watched: dict[str, Any] = field(default_factory=dict)
    space: tuple[int, int] = (0, 0)
    old_pattern: float | None = None  # s, on the tool-spaces text
    new_scan: float | None = None
    load: str = ""


def space_token() -> tuple[int, int]:
    """The default model's longest token of spaces (its prepared folder's tokenizer.json,
    there once serve has loaded the model)."""
    from tokenrelay.engine.models.store import resolve_model

    path = resolve_model("default", prepare=False) / "tokenizer.json"
    return longest_space_token(json.loads(path.read_text())["model"]["vocab"])


async def run_cases(addr: str, a: argparse.Namespace, run: Run) -> None:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        h = Hostile(addr, http, a.resumes, run.space, a.space_tokens)
        run.cases = [c for c in cases(h, a.resumes, a.space_tokens) if c.name in a.cases]
        floods = [c.name for c in run.cases if c.name in FLOODS]
        for case in run.cases:
            if floods and case.name == floods[0]:
                await h.start_stream(a.flood_stream_tokens)
                await asyncio.sleep(0.5)
            say(f"case {case.name}")
            case.start = time.monotonic()
            try:
                case.got = await case.run()
            except Exception as exc:
                case.got = Got(f"bench failed: {type(exc).__name__}: {exc}", 0.0, False)
            await asyncio.sleep(a.settle)
            case.end = time.monotonic()
            if floods and case.name == floods[-1]:
                await h.stop_stream()


def run(a: argparse.Namespace, workdir: Path) -> Run:
    port = free_port()
    args = ["serve", "--port", str(port), "--device", a.device, "--data-dir", str(workdir / "r")]
    serve = Proc(args, workdir / "serve.log")
    addr, res = f"127.0.0.1:{port}", Run()
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    mine, theirs = ctx.Pipe()
    mon = None
    try:
        started = time.monotonic()
        wait_ready(addr, serve, 600)
        say(f"serve ready on {addr} ({time.monotonic() - started:.1f} s)")
        res.space = space_token()
        mon = ctx.Process(target=monitor_main, args=(addr, a.victim_tokens, a.poll, stop, theirs))
        mon.start()
        if not mine.poll(300) or mine.recv() != "ready":
            raise RuntimeError("the victim stream did not start")
        asyncio.run(run_cases(addr, a, res))
        stop.set()
        if not mine.poll(60):
            raise RuntimeError("the monitor did not report")
        res.watched = mine.recv()
        res.load = load_average()
    finally:
        stop.set()
        if mon is not None:
            mon.join(10)
            if mon.is_alive():
                mon.kill()
        if serve.alive():
            serve.signal(signal.SIGTERM)
        serve.stop(60)
    text = next((c.got.text for c in res.cases if c.got and c.got.text), "")
    if text:  # after the measurements: the old pattern holds this process for seconds
        from tokenrelay.core.wire.tools import Tool, parse_tool_calls

        t = time.perf_counter()
        parse_tool_calls(text, (Tool("get_time"),), "s")
        res.new_scan = time.perf_counter() - t
        t = time.perf_counter()
        OLD_BLOCK_RE.findall(text)
        res.old_pattern = time.perf_counter() - t
    return res


def missed(res: Run) -> list[str]:
    """Each target missed and each answer not the documented one, in words."""
    tokens, polls = res.watched.get("tokens", []), res.watched.get("polls", [])
    out = []
    for c in res.cases:
        health = worst_latency(polls, c.start, c.end)
        gap = worst_gap(tokens, c.start, c.end)
        if health >= HEALTH_TARGET:
            out.append(f"{c.name}: /healthz took {health:.2f} s (target under {HEALTH_TARGET} s)")
        if failed_polls(polls, c.start, c.end):
            out.append(f"{c.name}: {failed_polls(polls, c.start, c.end)} /healthz polls failed")
        if gap >= GAP_TARGET:
            out.append(f"{c.name}: the victim waited {gap:.2f} s (target under {GAP_TARGET} s)")
        if c.got is None or not c.got.expected:
            answer = c.got.answer if c.got else "nothing"
            out.append(f"{c.name}: got {answer}, not the documented answer")
    return out


def report(res: Run, a: argparse.Namespace) -> str:
    tokens, polls = res.watched.get("tokens", []), res.watched.get("polls", [])
    ends = res.watched.get("ends", {})
    chosen = "" if tuple(a.cases) == DEFAULT_CASES else f" --cases {','.join(a.cases)}"
    lines = [
        f"`python -m bench.abuse --resumes {a.resumes} --space-tokens {a.space_tokens}{chosen}`, "
        f"{time.strftime('%Y-%m-%d')}, {machine()}, load average {res.load}",
        "",
        "| case | the hostile client sends | it gets | answered in | worst /healthz "
        "| worst victim gap |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for c in res.cases:
        got = c.got or Got("-", 0.0, False)
        took = "-" if c.name == "quiet" else f"{got.seconds:.2f} s"
        lines.append(
            f"| {c.name} | {c.sends} | {got.answer} | {took} "
            f"| {worst_latency(polls, c.start, c.end):.3f} s "
            f"| {worst_gap(tokens, c.start, c.end):.2f} s |"
        )
    lines += [
        "",
        f"- victim: {res.watched.get('streams', 0)} greedy WebSocket streams of "
        f"{a.victim_tokens} tokens, {len(tokens)} token frames, ended "
        + ", ".join(f"{k} {v}" for k, v in sorted(ends.items()))
        + f"; {len(polls)} /healthz polls, one every {a.poll:.2f} s at most",
        f"- targets: /healthz under {HEALTH_TARGET:.0f} s, victim gap under {GAP_TARGET:.0f} s",
    ]
    if "tool-spaces" in a.cases:
        lines.append(
            f"- tool-spaces: token {res.space[0]} is {res.space[1]} spaces (logit_bias +100)"
        )
    if res.old_pattern is not None and res.new_scan is not None:
        lines.append(
            f"- on the tool-spaces text, the block pattern used before commit 33001cb took "
            f"{res.old_pattern:.2f} s (GIL held); the call reader {res.new_scan * 1e3:.3f} ms"
        )
    lines += [f"- missed: {m}" for m in missed(res)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.abuse",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--resumes", type=int, default=200, help="resumes of the floods")
    ap.add_argument("--space-tokens", type=int, default=1280,
                    help="tool-spaces: max_tokens of its call (x 64 spaces)")  # fmt: skip
    ap.add_argument("--victim-tokens", type=int, default=64, help="max_tokens of a victim stream")
    ap.add_argument("--flood-stream-tokens", type=int, default=2048,
                    help="max_tokens of the stream the floods resume")  # fmt: skip
    ap.add_argument("--poll", type=float, default=0.05, help="seconds between /healthz polls")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds a case lasts after its last answer")  # fmt: skip
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES),
                    help="comma-separated cases to run")  # fmt: skip
    ap.add_argument("--device", default="cpu", help="serve's --device")
    ap.add_argument("--out", nargs="?", const=result_path("abuse.md"), type=Path,
                    help="also save the report (default bench/results/abuse.md)")  # fmt: skip
    a = ap.parse_args(argv)
    if a.resumes < 1 or a.space_tokens < 1:
        ap.error("--resumes and --space-tokens must be at least 1")
    a.cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    unknown = set(a.cases) - set(DEFAULT_CASES)
    if unknown or not a.cases:
        ap.error(f"--cases: unknown {sorted(unknown)}" if unknown else "--cases: none given")
    with tempfile.TemporaryDirectory(prefix="tokenrelay-abuse-") as tmp:
        res = run(a, Path(tmp))
    text = report(res, a)
    print(text)
    if a.out:
        write_result(a.out, text)
    return 1 if missed(res) else 0


if __name__ == "__main__":
    sys.exit(main())
