"""The screenshots in docs/screenshots/: the chat page on a desktop and on a phone, and the
widget on /embed-demo.

Set TOKENRELAY_SCREENSHOTS=1 to write them to docs/screenshots/ (otherwise they go to a
temporary folder, so a test run leaves the working tree alone). Take them on a quiet
machine: the figures under each answer (time to first token, tokens/s) are part of the
picture, so in that mode the test waits for an idle engine, warms the model up first, and
fails rather than keep figures a busy machine made absurd (then run it again).

The questions are ones the small default model answers sensibly at temperature 0.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.web.conftest import PageHandle, Server, _get
from tests.web.test_chat import ASSISTANT, ask, open_chat, wait_finished
from tests.web.test_widget import W_ASSISTANT, open_widget

pytestmark = pytest.mark.browser

CODE_Q = "Write a Python function that returns the square of a number, in a code block."
FACT_Q = "What is the capital of Japan?"
NEXT_Q = "Thanks! Can you add a docstring to it?"  # typed, not sent
PHONE_Q = "Give me three tips for staying focused."
WIDGET_Q = "Why should I carry water when hiking?"
WIDGET_MAX = 43  # the greedy answer's first three sentences, ending with a full stop

# What a figure under an answer may show in the docs (checked with TOKENRELAY_SCREENSHOTS=1).
MAX_TTFT_MS = 1500
MIN_TOKENS_PER_S = 5.0

FOR_DOCS = os.environ.get("TOKENRELAY_SCREENSHOTS") == "1"


def _engine_busy(server: Server) -> float:
    """Sequences running or waiting in the engine, from /metrics."""
    status, text = _get(server.base + "/metrics", timeout=5)
    if status != 200:
        return 0.0
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("tokenrelay_sequences_running", "tokenrelay_sequences_waiting")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _quiet_and_warm(server: Server) -> None:
    """Wait (up to a minute) for streams left by earlier tests to end, then warm up."""
    deadline = time.monotonic() + 60
    while _engine_busy(server) and time.monotonic() < deadline:
        time.sleep(0.5)
    for _ in range(2):
        frames = server.run(
            [
                {
                    "type": "generate",
                    "request_id": "warm-up",
                    "messages": [{"role": "user", "content": "Hello!"}],
                    "params": {"temperature": 0, "max_tokens": 16},
                }
            ]
        )
        assert frames[-1]["type"] == "done", frames[-3:]


def _check_figures(page: Any) -> None:
    """Every answer's time to first token and rate look like a healthy machine's."""
    metas = page.eval_on_selector_all(
        ASSISTANT + " [data-testid=message-meta]",
        "els => els.map(e => [e.dataset.ttftMs, e.dataset.tokensPerSec, e.textContent])",
    )
    assert metas
    for ttft, rate, text in metas:
        assert ttft is not None and int(ttft) <= MAX_TTFT_MS, f"busy machine? {text}"
        assert rate is None or float(rate) >= MIN_TOKENS_PER_S, f"busy machine? {text}"


def test_screenshots(
    desktop: PageHandle, phone: PageHandle, server: Server, screenshot_dir: Path
) -> None:
    _quiet_and_warm(server)

    page = open_chat(desktop, server, "?temperature=0&max_tokens=120")
    page.wait_for_selector("[data-testid=model][data-ready=true]")
    ask(page, CODE_Q)
    assert wait_finished(page) == "done"
    ask(page, FACT_Q)
    assert wait_finished(page) == "done"
    assert page.locator(ASSISTANT + " pre code.hljs span.hljs-keyword").count() > 0
    page.locator("[data-testid=composer]").fill(NEXT_Q)
    page.mouse.move(0, 0)  # no hover effect on the Send button
    if FOR_DOCS:
        _check_figures(page)
    page.screenshot(path=str(screenshot_dir / "chat-desktop.png"))

    ppage = open_chat(phone, server, "?temperature=0&max_tokens=160")
    ask(ppage, PHONE_Q)
    assert wait_finished(ppage) == "done"
    if FOR_DOCS:
        _check_figures(ppage)
    ppage.screenshot(path=str(screenshot_dir / "chat-phone.png"))

    wpage = desktop.page
    open_widget(desktop, server)
    wpage.locator("tokenrelay-chat").evaluate(
        f"el => {{ el.setAttribute('max-tokens', '{WIDGET_MAX}');"
        " el.setAttribute('temperature', '0'); }"
    )
    wpage.locator("tokenrelay-chat [data-testid=composer]").fill(WIDGET_Q)
    wpage.locator("tokenrelay-chat [data-testid=composer]").press("Enter")
    wpage.wait_for_selector(W_ASSISTANT + ":not([data-state=streaming])", timeout=120_000)
    wpage.screenshot(path=str(screenshot_dir / "widget.png"))

    for name in ("chat-desktop.png", "chat-phone.png", "widget.png"):
        size = (screenshot_dir / name).stat().st_size
        assert 10_000 < size < 250_000, (name, size)
    assert desktop.console_errors() == []
    assert phone.console_errors() == []
