"""The widget's live attributes, its ``tokenrelay:error`` event and its dark theme.

On ``/embed-demo`` (served by the ``server`` fixture, no API keys): attributes changed after
mount take effect (``endpoint`` swaps the client and the conversation), a refused request
emits one error event, and the theme follows ``prefers-color-scheme`` unless the ``theme``
attribute says otherwise (computed styles in Chromium).
"""

from __future__ import annotations

import pytest

from tests.web.conftest import PageHandle, Server, _free_port
from tests.web.test_widget import open_widget

pytestmark = pytest.mark.browser

CHAT = "document.querySelector('tokenrelay-chat')"
CONN = "tokenrelay-chat [data-testid=connection]"
MESSAGES = "tokenrelay-chat [data-testid=message]"
ERRORS_INIT = (
    "window.__errors = [];"
    "document.addEventListener('tokenrelay:error', (e) => window.__errors.push(e.detail));"
)
SPY = """el => {
  window.__reqs = []; window.__results = [];
  const c = el.client, generate = c.generate.bind(c);
  c.generate = (r) => {
    const s = generate(r);
    window.__reqs.push(r);
    s.finished.then((f) => window.__results.push(f));
    return s;
  };
}"""


def send(h: PageHandle, text: str) -> None:
    box = h.page.locator("tokenrelay-chat [data-testid=composer]")
    box.fill(text)
    box.press("Enter")


def test_attributes_changed_after_mount_take_effect(desktop: PageHandle, server: Server) -> None:
    p = desktop.page
    open_widget(desktop, server)
    chat = p.locator("tokenrelay-chat")
    chat.evaluate("el => el.setAttribute('greeting', 'Howdy!')")
    chat.evaluate("el => el.setAttribute('placeholder', 'Ask away')")
    assert p.locator("tokenrelay-chat .empty").inner_text() == "Howdy!"
    composer = p.locator("tokenrelay-chat [data-testid=composer]")
    assert composer.get_attribute("placeholder") == "Ask away"

    chat.evaluate(SPY)
    chat.evaluate(
        "el => { el.setAttribute('system', 'Answer in one word.');"
        " el.setAttribute('temperature', '0'); el.setAttribute('max-tokens', '4');"
        " el.setAttribute('seed', '7'); }"
    )
    send(desktop, "Hi")
    p.wait_for_function("() => window.__results.length === 1", timeout=120_000)
    req = p.evaluate("() => window.__reqs[0]")
    assert req["messages"][0] == {"role": "system", "content": "Answer in one word."}
    # and 5 minutes of generating while the page is away (a locked phone)
    assert req["params"] == {"temperature": 0, "max_tokens": 4, "seed": 7, "detach_timeout": 300}
    result = p.evaluate("() => window.__results[0]")
    assert result["error"] is None and result["usage"]["completion_tokens"] <= 4
    assert p.locator(MESSAGES).count() == 2

    # another endpoint: a new client, that gateway's own (empty) conversation
    port = _free_port()  # nothing listens there
    p.evaluate(f"() => {{ window.__old = {CHAT}.client;"
               f" {CHAT}.setAttribute('endpoint', 'http://127.0.0.1:{port}'); }}")  # fmt: skip
    p.wait_for_selector(CONN + "[data-state=reconnecting]")
    assert p.evaluate(f"() => {CHAT}.client.url") == f"ws://127.0.0.1:{port}/v1/ws"
    assert p.evaluate("() => window.__old.state") == "closed"
    assert p.locator(MESSAGES).count() == 0
    # and back: connected again, the conversation kept for it is back
    chat.evaluate(f"el => el.setAttribute('endpoint', '{server.base}')")
    p.wait_for_selector(CONN + "[data-state=open]")
    assert p.locator(MESSAGES).count() == 2

    # inline: a panel in the page, shown even when not "open"
    chat.evaluate("el => { el.open = false; }")
    p.wait_for_selector("tokenrelay-chat [data-testid=widget-panel]", state="hidden")
    chat.evaluate("el => el.setAttribute('inline', '')")
    p.wait_for_selector("tokenrelay-chat [data-testid=widget-panel]", state="visible")
    assert desktop.console_errors(allow=(f"127.0.0.1:{port}",)) == []


def test_a_refused_request_emits_one_error_event(desktop: PageHandle, server: Server) -> None:
    p = desktop.page
    p.add_init_script(ERRORS_INIT)
    open_widget(desktop, server)
    p.locator("tokenrelay-chat").evaluate("el => el.setAttribute('max-tokens', '999999')")
    send(desktop, "Hi")
    p.wait_for_selector(MESSAGES + "[data-role=assistant][data-state=error]")
    errors = p.evaluate("() => window.__errors")
    assert len(errors) == 1, errors
    assert errors[0]["code"] == "bad_request" and "max_tokens" in errors[0]["message"]
    assert errors[0]["source"] == "stream" and errors[0]["fatal"] is True
    # shown on the answer; the connection itself is fine
    assert p.locator("tokenrelay-chat [data-testid=widget-error]").is_hidden()
    assert p.locator(CONN).get_attribute("data-state") == "open"


def _styles(h: PageHandle) -> dict[str, str]:
    return dict(
        h.page.evaluate(
            f"""() => {{
              const root = {CHAT}.shadowRoot;
              const panel = getComputedStyle(root.querySelector('.panel'));
              return {{ bg: panel.backgroundColor, fg: panel.color,
                        userBg: panel.getPropertyValue('--_user-bg').trim(),
                        scheme: getComputedStyle(root.querySelector('textarea')).colorScheme,
                        accent: getComputedStyle(root.querySelector('.launcher'))
                          .backgroundColor }};
            }}"""
        )
    )


LIGHT = {"bg": "rgb(255, 255, 255)", "fg": "rgb(29, 29, 34)", "scheme": "light"}
DARK = {"bg": "rgb(28, 28, 33)", "fg": "rgb(236, 236, 241)", "scheme": "dark"}


def _looks(h: PageHandle, want: dict[str, str]) -> None:
    got = _styles(h)
    assert {k: got[k] for k in want} == want
    assert got["accent"] == "rgb(20, 83, 45)"  # the host page's --tokenrelay-accent, both themes


def test_theme_follows_the_system_unless_the_attribute_says(
    desktop: PageHandle, server: Server
) -> None:
    p = desktop.page
    open_widget(desktop, server)
    chat = p.locator("tokenrelay-chat")
    _looks(desktop, LIGHT)
    # /embed-demo sets --tokenrelay-user-bg for its light look; dark has its own default
    assert _styles(desktop)["userBg"] == "#ecfccb"
    p.emulate_media(color_scheme="dark")
    _looks(desktop, DARK)
    assert _styles(desktop)["userBg"] == "#312e81"
    chat.evaluate("el => el.setAttribute('theme', 'light')")
    _looks(desktop, LIGHT)
    p.emulate_media(color_scheme="light")
    chat.evaluate("el => el.setAttribute('theme', 'dark')")
    _looks(desktop, DARK)
    chat.evaluate("el => el.setAttribute('theme', 'auto')")
    _looks(desktop, LIGHT)
    assert desktop.console_errors() == []
