"""The embeddable widget on ``/embed-demo``, and the screenshots for the docs.

Set TOKENRELAY_SCREENSHOTS=1 to write the screenshots to docs/screenshots/ (otherwise they go
to a temporary folder, so a test run leaves the working tree alone).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.web.conftest import PageHandle, Server
from tests.web.test_chat import SHORT_MAX, SHORT_Q, ask, open_chat, wait_finished

pytestmark = pytest.mark.browser

W_ASSISTANT = "tokenrelay-chat [data-testid=message][data-role=assistant]"


def open_widget(h: PageHandle, server: Server) -> None:
    page = h.page
    page.goto(server.base + "/embed-demo")
    page.wait_for_selector("tokenrelay-chat [data-testid=widget-launcher]")
    page.click("tokenrelay-chat [data-testid=widget-launcher]")
    page.wait_for_selector("tokenrelay-chat [data-testid=widget-panel]")
    page.wait_for_selector("tokenrelay-chat [data-testid=connection][data-state=open]")


def test_widget_chats_on_a_third_party_page(desktop: PageHandle, server: Server) -> None:
    page = desktop.page
    open_widget(desktop, server)
    host = page.locator("tokenrelay-chat")
    assert host.get_attribute("endpoint") == server.base
    assert page.evaluate("() => !!document.querySelector('tokenrelay-chat').shadowRoot")
    # isolated: the page's own styles and scripts do not see the widget's nodes
    assert page.evaluate("() => document.querySelectorAll('[data-testid=composer]').length") == 0
    # themed by the host page through a CSS custom property
    accent = page.evaluate(
        "() => getComputedStyle(document.querySelector('tokenrelay-chat')"
        ".shadowRoot.querySelector('.launcher')).backgroundColor"
    )
    assert accent == "rgb(20, 83, 45)"  # --tokenrelay-accent: #14532d on /embed-demo
    host.evaluate(
        "el => { el.setAttribute('max-tokens', '24'); el.setAttribute('temperature', '0'); }"
    )
    box = page.locator("tokenrelay-chat [data-testid=composer]")
    box.fill('Hello <img src=x onerror="window.__xss=1">')
    box.press("Enter")
    page.wait_for_function(
        "() => { const r = document.querySelector('tokenrelay-chat').shadowRoot;"
        " const m = [...r.querySelectorAll('[data-role=assistant]')].at(-1);"
        " return m && m.dataset.state !== 'streaming' && m.textContent.trim().length > 0; }",
        timeout=120_000,
    )
    assert page.locator(W_ASSISTANT).last.get_attribute("data-state") == "done"
    user = page.locator("tokenrelay-chat [data-testid=message][data-role=user]").last
    assert user.inner_text().strip().endswith('<img src=x onerror="window.__xss=1">')
    assert page.locator("tokenrelay-chat img").count() == 0
    assert page.evaluate("() => window.__xss") is None
    # Esc closes the panel and gives focus back to the bubble
    page.keyboard.press("Escape")
    page.wait_for_selector("tokenrelay-chat [data-testid=widget-panel]", state="hidden")
    assert desktop.console_errors() == []


def test_widget_stop_button(desktop: PageHandle, server: Server) -> None:
    page = desktop.page
    open_widget(desktop, server)
    page.evaluate(
        "() => document.querySelector('tokenrelay-chat').setAttribute('max-tokens', '160')"
    )
    page.locator("tokenrelay-chat [data-testid=composer]").fill(
        "Write a long story about a lighthouse keeper who finds a robot on the beach."
    )
    page.click("tokenrelay-chat [data-testid=send]")
    page.wait_for_function(
        "() => { const r = document.querySelector('tokenrelay-chat').shadowRoot;"
        " const m = [...r.querySelectorAll('[data-role=assistant]')].at(-1);"
        " return m && m.dataset.state === 'streaming' && m.textContent.length > 10; }"
    )
    page.click("tokenrelay-chat [data-testid=stop]")
    page.wait_for_selector(W_ASSISTANT + "[data-state=cancelled]", timeout=20_000)
    assert desktop.console_errors() == []


# --- screenshots --------------------------------------------------------------------------

CODE_Q = "Write a Python function that returns the square of a number, in a code block."


def test_screenshots(
    desktop: PageHandle, phone: PageHandle, server: Server, screenshot_dir: Path
) -> None:
    page = open_chat(desktop, server, "?temperature=0&max_tokens=120")
    ask(page, CODE_Q)
    wait_finished(page)
    ask(page, SHORT_Q)
    wait_finished(page)
    page.locator("[data-testid=composer]").fill("Thanks! And the capital of Italy?")
    page.screenshot(path=str(screenshot_dir / "chat-desktop.png"))

    ppage = open_chat(phone, server, f"?temperature=0&max_tokens={SHORT_MAX}")
    ask(ppage, SHORT_Q)
    wait_finished(ppage)
    ppage.screenshot(path=str(screenshot_dir / "chat-phone.png"))

    wpage = desktop.page
    open_widget(desktop, server)
    wpage.locator("tokenrelay-chat").evaluate("el => el.setAttribute('max-tokens', '60')")
    wpage.locator("tokenrelay-chat [data-testid=composer]").fill("Which boots for wet trails?")
    wpage.locator("tokenrelay-chat [data-testid=composer]").press("Enter")
    wpage.wait_for_selector(W_ASSISTANT + ":not([data-state=streaming])", timeout=120_000)
    wpage.screenshot(path=str(screenshot_dir / "widget.png"))

    for name in ("chat-desktop.png", "chat-phone.png", "widget.png"):
        assert (screenshot_dir / name).stat().st_size > 10_000
    assert desktop.console_errors() == []
    assert phone.console_errors() == []
