"""The embeddable widget on ``/embed-demo`` (its screenshot for the docs: test_screenshots.py)."""

from __future__ import annotations

import pytest

from tests.web.conftest import PageHandle, Server

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
