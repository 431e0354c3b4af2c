"""The Python client against real processes: the suite's engine worker (the default
model) and gateways on Redis (tests/gateway/stack.py), plus gateways of this module's own
(a tiny ``--max-pending``; one that drains). Sockets are cut by a TCP proxy in front of a
gateway (tests/client/proxy.py), as a network would cut them."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.client.proxy import CutProxy
from tests.gateway.procs import Client as RawClient
from tests.gateway.procs import generate_frame, start_gateway, wait_ready
from tests.gateway.stack import Stack
from tests.root import ROOT
from tokenrelay.client import (
    AsyncClient,
    AsyncStream,
    BadRequestError,
    Client,
    FinishReason,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    RetryPolicy,
    TokenRelayError,
)
from tokenrelay.core.wire.vocabulary import ErrorCode

PROMPT = "Write a short story about a lighthouse keeper and a storm."
MESSAGES = [{"role": "user", "content": PROMPT}]
TOKENS = 64
GREEDY: dict[str, Any] = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
FAST = RetryPolicy(initial=0.05, maximum=0.5)  # quick reconnects for the tests


@pytest.fixture(scope="module")
def reference(stack: Stack) -> str:
    """The greedy text of MESSAGES, streamed once on a raw socket that never drops."""

    async def run() -> str:
        c = await RawClient.open(stack.a)
        try:
            await c.send(generate_frame(PROMPT, "ref", **GREEDY))
            frames = await c.recv_until(lambda f: f["type"] in ("done", "error"), 120)
        finally:
            await c.close()
        assert frames[-1]["type"] == "done", frames[-1]
        return "".join(f["text"] for f in frames if f["type"] == "token")

    text = asyncio.run(run())
    assert len(text) > 40
    return text


@pytest.fixture
async def proxy(stack: Stack) -> AsyncIterator[CutProxy]:
    p = CutProxy(stack.a)
    await p.start()
    try:
        yield p
    finally:
        await p.close()


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("client-logs")


@pytest.fixture(scope="module")
def one_slot(stack: Stack, logs: Path) -> Iterator[str]:
    """A gateway of the suite's fleet that answers ``overloaded`` past one pending request."""
    gw, addr = start_gateway(stack.redis.url, stack.prefix, logs, "--max-pending", "1")
    try:
        wait_ready(addr, gw, 60)
        yield addr
    finally:
        gw.stop()


async def read_all(s: AsyncStream) -> str:
    return "".join([text async for text in s])


def exactly_once(s: AsyncStream, deltas: list[str]) -> None:
    """The deltas were seqs 1 .. done-1, each once: nothing dropped, doubled or skipped."""
    assert s.finished and len(deltas) == s.last_seq - 1
    assert s.duplicates == 0 and s.gaps == 0


async def test_streamed_text_equals_an_uninterrupted_run(stack: Stack, reference: str) -> None:
    async with AsyncClient(f"http://{stack.a}", api_key=None) as c:
        s = await c.chat(MESSAGES, **GREEDY)
        assert s.stream_id and s.resume_token and s.prompt_tokens
        deltas = [text async for text in s]
        assert "".join(deltas) == reference
    exactly_once(s, deltas)
    assert s.text == reference and s.finish_reason == FinishReason.LENGTH
    assert s.usage is not None and s.usage.completion_tokens == TOKENS
    assert s.tool_calls == [] and s.error is None and s.resumes == 0


async def test_sockets_cut_mid_answer_resume_with_no_gap_or_duplicate(
    stack: Stack, reference: str, proxy: CutProxy
) -> None:
    async with AsyncClient(f"http://{proxy.addr}", retry=FAST) as c:
        s = await c.chat(MESSAGES, **GREEDY)
        out: list[str] = []
        async for text in s:
            out.append(text)
            if len(out) in (3, 12, 24) and not s.finished:
                assert proxy.cut() >= 1  # the socket, reset with no close frame
    assert "".join(out) == reference == s.text
    exactly_once(s, out)
    assert s.finish_reason == FinishReason.LENGTH
    assert s.resumes >= 1 and c.connects >= 2 and proxy.accepted == c.connects


async def test_cancel_stops_generating(stack: Stack) -> None:
    async with AsyncClient(f"http://{stack.a}") as c:
        s = await c.chat(MESSAGES, max_tokens=2000, temperature=0, ignore_eos=True)
        got = []
        async for text in s:
            got.append(text)
            if len(got) == 3:
                await s.cancel()
        assert s.finish_reason == FinishReason.CANCELLED and s.error is None
        assert s.usage is not None and s.usage.completion_tokens < 2000
        assert "".join(got) == s.text
        await s.cancel()  # idempotent: it had ended
        assert s.finish_reason == FinishReason.CANCELLED


async def test_a_second_client_resumes_by_token(stack: Stack, reference: str) -> None:
    async with AsyncClient(f"http://{stack.a}") as first:
        s = await first.chat(MESSAGES, **GREEDY)
        async for _ in s:
            if s.last_seq >= 5:
                break
        sid, token, after, head = s.stream_id, s.resume_token, s.last_seq, s.text
    assert sid and token
    # leaving (closing the client) detached the stream: it kept generating into Redis
    async with AsyncClient(f"http://{stack.b}") as second:
        r = await second.resume(sid, token, after=after)
        tail = await read_all(r)
    assert head + tail == reference and r.resumes == 1
    assert r.finish_reason == FinishReason.LENGTH and r.stream_id == sid
    async with AsyncClient(f"http://{stack.a}") as third:  # the whole text, once more
        assert await (await third.resume(sid, token)).wait() == reference


def test_the_blocking_client_and_a_resume_from_another_process(
    stack: Stack, reference: str
) -> None:
    with Client(f"http://{stack.a}") as c:
        s = c.chat(MESSAGES, **GREEDY)
        deltas = list(s)
        assert "".join(deltas) == reference == s.text
        assert s.finish_reason == FinishReason.LENGTH and s.stream_id and s.resume_token
        stopped = c.chat(MESSAGES, max_tokens=2000, temperature=0, ignore_eos=True)
        stopped.cancel()
        assert stopped.finish_reason == FinishReason.CANCELLED
    script = (
        "import sys\nfrom tokenrelay.client import Client\n"
        "with Client(sys.argv[1]) as c:\n"
        "    r = c.resume(sys.argv[2], sys.argv[3], after=4)\n"
        "    sys.stdout.write(''.join(r))\n"
    )
    args = [sys.executable, "-c", script, f"http://{stack.b}", s.stream_id, s.resume_token]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "".join(deltas[:4]) + out.stdout == reference  # delta i is seq i + 1


async def test_bad_requests_raise_typed_errors(stack: Stack) -> None:
    async with AsyncClient(f"http://{stack.a}") as c:
        with pytest.raises(BadRequestError) as bad:
            await c.chat(MESSAGES, temperature=5)
        assert bad.value.code == ErrorCode.BAD_REQUEST and "temperature" in bad.value.message
        assert bad.value.request_id and isinstance(bad.value, TokenRelayError)
        with pytest.raises(BadRequestError, match="colour"):
            await c.chat(MESSAGES, colour="blue")
        with pytest.raises(NotFoundError):
            await c.chat(MESSAGES, model="no-such-model", max_tokens=4)
        s = await c.chat(MESSAGES, max_tokens=4, temperature=0)
        await s.wait()
        assert s.stream_id
        with pytest.raises(PermissionDeniedError):
            await c.resume(s.stream_id, "wrong-token")
        with pytest.raises(NotFoundError):
            await c.resume("A" * 22, "no-such-token")
        # the socket stays usable after errors
        assert (await (await c.chat(MESSAGES, max_tokens=4, temperature=0)).wait()) == s.text
        assert c.connects == 1


async def test_overloaded_is_retried_with_backoff(one_slot: str) -> None:
    impatient = AsyncClient(f"http://{one_slot}", retry=RetryPolicy(limit=0))
    async with impatient, AsyncClient(f"http://{one_slot}") as c:
        busy = await c.chat(MESSAGES, max_tokens=24, temperature=0, ignore_eos=True)
        with pytest.raises(OverloadedError) as over:  # no retries allowed: refused
            await impatient.chat(MESSAGES, max_tokens=4)
        assert over.value.retry_after is not None and over.value.retry_after >= 1
        s = await c.chat(MESSAGES, max_tokens=4, temperature=0)  # waits its turn
        assert s.retries >= 1
        assert busy.finished  # it got the slot only once the first one ended
        await s.wait()
        assert s.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


async def test_a_draining_gateway_hands_its_streams_over(
    stack: Stack, reference: str, logs: Path, proxy: CutProxy
) -> None:
    gw, addr = start_gateway(stack.redis.url, stack.prefix, logs, "--drain-timeout", "0")
    try:
        wait_ready(addr, gw, 60)
        proxy.target = addr
        async with AsyncClient(f"http://{proxy.addr}", retry=FAST) as c:
            s = await c.chat(MESSAGES, **GREEDY)
            out = []
            async for text in s:
                out.append(text)
                if len(out) == 3:  # the load balancer moves on; the gateway drains
                    proxy.target = stack.a
                    gw.terminate()
            assert "".join(out) == reference
            assert c.drains == 1 and s.resumes == 1
            # new streams went to the next gateway as soon as the notice came
            assert await (await c.chat(MESSAGES, max_tokens=4, temperature=0)).wait()
        assert gw.wait_stopped(30) == 0  # it drained and exited
    finally:
        gw.stop()


def test_the_examples_of_the_docs_run(stack: Stack) -> None:
    """The Python blocks of docs/client.md's "Python client", run against a gateway."""
    doc = (ROOT / "docs" / "client.md").read_text()
    section = doc[doc.index("## Python client") :]
    section = section[: section.index("\n## ")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 4
    script = "\n".join(b.replace("http://127.0.0.1:8000", f"http://{stack.a}") for b in blocks)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bad_request temperature" in out.stdout and "Usage(prompt_tokens=" in out.stdout
    assert "[calling get_weather] {" in out.stdout and "tool_calls [{'id': 'call_" in out.stdout
