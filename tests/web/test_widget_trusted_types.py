"""The widget on a page that enforces Trusted Types, with the options of its script tag.

The host page (tests/web/hostsite.py on 127.0.0.1, another origin than the gateway of the
``server`` fixture) is served with ``require-trusted-types-for 'script'`` and a
``trusted-types`` list that allows only the widget's own policy, ``tokenrelay-widget``: an
``innerHTML`` or any other string-to-HTML sink, or a policy of another name (DOMPurify's
own, ``dompurify``), would be a violation. The widget is mounted by its ``<script>`` tag with
``data-model`` and ``data-strings``, streams a Markdown answer, and the page sees no
``securitypolicyviolation`` event and no console error; the ``generate`` frame on the socket
names the model.
"""

from __future__ import annotations

import html
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.web.conftest import PageHandle, Server, _free_port, _open_page
from tests.web.hostsite import HostSite

pytestmark = pytest.mark.browser

CONN = "tokenrelay-chat [data-testid=connection]"
ANSWER = "tokenrelay-chat [data-testid=message][data-role=assistant]"
VIOLATIONS_INIT = (
    "window.__violations = [];"
    "document.addEventListener('securitypolicyviolation', (e) => window.__violations.push("
    "{directive: e.violatedDirective, sample: e.sample, source: e.sourceFile}));"
)


def served_model(server: Server) -> str:
    with urllib.request.urlopen(server.base + "/v1/models", timeout=10) as r:
        return str(json.load(r)["data"][0]["id"])


@pytest.fixture(scope="module")
def site(server: Server) -> Iterator[HostSite]:
    s = HostSite("127.0.0.1", _free_port(), server.base, api_key="")
    ws_origin = server.base.replace("http://", "ws://")
    s.csp = (
        f"default-src 'self'; script-src 'self' {server.base}; "
        f"connect-src 'self' {ws_origin}; img-src 'self' data:; style-src 'self'; "
        "require-trusted-types-for 'script'; trusted-types tokenrelay-widget"
    )
    strings = html.escape(json.dumps({"send": "Senden", "stateOpen": "Verbunden"}), quote=True)
    s.pages["/"] = (
        '<!doctype html><html lang="de"><head><meta charset="utf-8">'
        '<link rel="icon" href="data:,"><title>Strict</title></head>'
        "<body><h1>Strict</h1>"
        f'<script src="{server.base}/static/widget.js" data-endpoint="{server.base}" '
        f'data-model="{html.escape(served_model(server))}" data-strings="{strings}" '
        'data-open="true" data-temperature="0" data-max-tokens="24" async></script>'
        "</body></html>"
    )
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def page(browser: Any, site: HostSite) -> Iterator[PageHandle]:
    h = _open_page(browser, viewport={"width": 1280, "height": 800})
    h.page.add_init_script(VIOLATIONS_INIT)
    try:
        yield h
    finally:
        h.context.close()


def test_widget_streams_markdown_under_trusted_types(
    page: PageHandle, site: HostSite, server: Server
) -> None:
    p = page.page
    sent: list[dict[str, Any]] = []
    p.on("websocket", lambda ws: ws.on("framesent", lambda data: sent.append(json.loads(data))))
    p.goto(site.origin + "/")
    p.wait_for_selector(CONN + "[data-state=open]", timeout=60_000)
    # the script tag's data-strings, through the one table of texts
    assert p.locator("tokenrelay-chat [data-testid=send]").inner_text() == "Senden"
    assert p.locator(CONN).inner_text().strip() == "Verbunden"
    assert p.locator("tokenrelay-chat .launcher svg path").count() == 1  # built, not parsed
    box = p.locator("tokenrelay-chat [data-testid=composer]")
    box.fill("Write a short list of three fruits, in Markdown.")
    box.press("Enter")
    p.wait_for_selector(
        "tokenrelay-chat [data-role=assistant]:not([data-state=streaming])", timeout=120_000
    )
    answer = p.locator(ANSWER).last
    assert answer.get_attribute("data-state") == "done"
    assert answer.inner_text().strip()
    # rendered by markdown.js (marked, then DOMPurify through the policy): real elements
    body = "tokenrelay-chat [data-role=assistant] [data-testid=message-content]"
    assert p.eval_on_selector(body, "n => n.children.length") >= 1
    generates = [f for f in sent if f.get("type") == "generate"]
    assert len(generates) == 1 and generates[0]["model"] == served_model(server)

    assert p.evaluate("() => window.__violations") == []
    assert page.console_errors() == []
    # and the page does enforce Trusted Types: an HTML string is refused, and reported
    refused = p.evaluate(
        "() => { try { document.createElement('div').innerHTML = '<b>x</b>'; return false; }"
        " catch (e) { return e instanceof TypeError; } }"
    )
    assert refused is True
    p.wait_for_function("() => window.__violations.length === 1")
    assert p.evaluate("() => window.__violations[0].directive") == "require-trusted-types-for"
