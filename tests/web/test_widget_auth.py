"""The widget on a gateway with API keys, embedded by another site (another origin).

The host site (tests/web/hostsite.py, on 127.0.0.2) has a strict Content-Security-Policy
and a one-route backend that trades the API key for short-lived WebSocket tokens with
``POST /v1/ws-token``; the key never reaches the browser. The gateway (conftest's
``keyed_gateway``: ``--api-keys``, ``--allow-origin`` for that site) shares the engine
worker of the ``server`` fixture.
"""

from __future__ import annotations

import itertools
import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.web.conftest import KeyedGateway, PageHandle, _open_page
from tests.web.hostsite import HostSite

pytestmark = pytest.mark.browser

CONN = "tokenrelay-chat [data-testid=connection]"
ALERT = "tokenrelay-chat [data-testid=widget-error]"
ERRORS_INIT = (
    "window.__errors = [];"
    "document.addEventListener('tokenrelay:error', (e) => window.__errors.push(e.detail));"
)


def shop_page(title: str, widget: str) -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<link rel="icon" href="data:,"><title>{title}</title></head>'
        f"<body><h1>{title}</h1><p>Somebody else's site.</p>{widget}</body></html>"
    )


@pytest.fixture(scope="module")
def site(keyed_gateway: KeyedGateway) -> Iterator[HostSite]:
    gw = keyed_gateway
    host, port = gw.allowed_origin.removeprefix("http://").split(":")
    s = HostSite(host, int(port), gw.base, gw.key)
    ws_origin = gw.base.replace("http://", "ws://")
    # what an embedding site must allow (docs/client.md, "Content-Security-Policy")
    s.csp = (
        f"default-src 'self'; script-src 'self' {gw.base}; connect-src 'self' {ws_origin}; "
        "img-src 'self' data:; style-src 'self'"
    )
    # the one-tag embed, with the token URL on the site's own backend
    s.pages["/"] = shop_page(
        "Shop",
        f'<script src="{gw.base}/static/widget.js" data-endpoint="{gw.base}" '
        'data-token-url="/token" data-open="true" data-temperature="0" '
        'data-max-tokens="12" async></script>',
    )
    # the element placed by hand; a test loads the script later
    s.pages["/plain"] = shop_page(
        "Plain", f'<tokenrelay-chat endpoint="{gw.base}" inline></tokenrelay-chat>'
    )
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def page(browser: Any, site: HostSite) -> Iterator[PageHandle]:
    site.fail_next = 0
    site.token_times.clear()
    h = _open_page(browser, viewport={"width": 1280, "height": 800})
    h.page.add_init_script(ERRORS_INIT)
    try:
        yield h
    finally:
        h.context.close()


def test_the_origin_is_foreign_to_the_gateway(keyed_gateway: KeyedGateway, site: HostSite) -> None:
    """127.0.0.2 passes only because of --allow-origin, and only with a token."""
    ws = keyed_gateway.base.replace("http://", "ws://") + "/v1/ws"
    req = urllib.request.Request(
        keyed_gateway.base + "/v1/ws-token",
        method="POST",
        headers={"Authorization": f"Bearer {keyed_gateway.key}"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        token = json.load(r)["token"]
    with pytest.raises(InvalidStatus) as refused:
        connect(f"{ws}?token={token}", additional_headers={"Origin": "http://127.0.0.2:1"})
    assert refused.value.response.status_code == 403
    with connect(f"{ws}", additional_headers={"Origin": site.origin}, open_timeout=10) as c:
        assert json.loads(c.recv(timeout=10))["code"] == "unauthorized"
    with connect(f"{ws}?token={token}", additional_headers={"Origin": site.origin}) as c:
        assert json.loads(c.recv(timeout=10))["type"] == "hello"


def test_widget_from_another_site_answers_on_a_keyed_gateway(
    page: PageHandle, site: HostSite, keyed_gateway: KeyedGateway
) -> None:
    p = page.page
    urls: list[str] = []
    p.on("request", lambda r: urls.append(r.url))
    p.on("websocket", lambda ws: urls.append(ws.url))
    p.goto(site.origin + "/")
    p.wait_for_selector(CONN + "[data-state=open]", timeout=60_000)
    assert len(site.token_times) == 1
    # styled (constructed stylesheets need no 'unsafe-inline' in style-src)
    panel = "tokenrelay-chat [data-testid=widget-panel]"
    assert p.eval_on_selector(panel, "n => getComputedStyle(n).display") == "flex"
    box = p.locator("tokenrelay-chat [data-testid=composer]")
    box.fill("What is the capital of France?")
    box.press("Enter")
    answer = p.locator("tokenrelay-chat [data-testid=message][data-role=assistant]").last
    p.wait_for_selector(
        "tokenrelay-chat [data-role=assistant]:not([data-state=streaming])", timeout=120_000
    )
    assert answer.get_attribute("data-state") == "done"
    assert answer.inner_text().strip()
    # a reconnect asks the backend for a fresh token first
    p.evaluate("() => document.querySelector('tokenrelay-chat').client.dropConnection()")
    p.wait_for_function(
        "() => document.querySelector('tokenrelay-chat').client.stats.reconnects === 1"
    )
    assert len(site.token_times) == 2
    # the key stays on the host site's server
    assert keyed_gateway.key not in p.content()
    assert not any(keyed_gateway.key in u for u in urls)
    assert any("/v1/ws?token=v1." in u for u in urls)
    assert p.evaluate("() => window.__errors") == []
    assert page.console_errors() == []  # no CSP violation either


def test_a_failing_token_url_shows_an_error_and_backs_off(page: PageHandle, site: HostSite) -> None:
    p = page.page
    site.fail_next = 3
    p.goto(site.origin + "/")
    p.wait_for_selector(ALERT + ":has-text('HTTP 500')")
    p.wait_for_selector(CONN + "[data-state=open]", timeout=30_000)
    assert p.locator(ALERT).is_hidden()  # gone once connected
    times = site.token_times
    assert len(times) == 4
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # 250 ms doubling, each drawn from [d/2, d]: never a tight loop
    assert all(g >= 0.1 for g in gaps), gaps
    assert gaps[2] > gaps[0], gaps
    errors = p.evaluate("() => window.__errors")
    assert [e["code"] for e in errors] == ["token_failed"] * 3
    assert all(e["source"] == "token" and e["fatal"] is False for e in errors)
    assert "HTTP 500" in errors[0]["message"]

    # a new token-url takes effect at once: reconnect with it
    chat = p.locator("tokenrelay-chat")
    chat.evaluate("el => el.setAttribute('token-url', '/missing')")
    p.wait_for_selector(ALERT + ":has-text('HTTP 404')")
    chat.evaluate("el => el.setAttribute('token-url', '/token')")
    p.wait_for_selector(CONN + "[data-state=open]", timeout=30_000)
    assert p.locator(ALERT).is_hidden()
    assert page.console_errors(allow=("404", "500")) == []


def test_token_property_set_before_the_widget_script_loads(
    page: PageHandle, site: HostSite, keyed_gateway: KeyedGateway
) -> None:
    p = page.page
    p.goto(site.origin + "/plain")
    p.evaluate(
        """() => {
          window.__calls = 0;
          const el = document.querySelector('tokenrelay-chat');
          el.token = async () => {
            window.__calls += 1;
            const r = await fetch('/token');
            return (await r.json()).token;
          };
          el.setAttribute('open', '');
        }"""
    )
    p.add_script_tag(url=keyed_gateway.base + "/static/widget.js")
    p.wait_for_selector(CONN + "[data-state=open]", timeout=30_000)
    assert p.evaluate("() => window.__calls") == 1
    assert p.evaluate("() => typeof document.querySelector('tokenrelay-chat').token") == "function"

    # a token the gateway refuses: one error event, the server's reason, no retry loop
    p.evaluate("() => { document.querySelector('tokenrelay-chat').token = 'v1.forged'; }")
    p.wait_for_selector(CONN + "[data-state=closed]")
    time.sleep(0.5)
    errors = p.evaluate("() => window.__errors")
    assert len(errors) == 1, errors
    assert errors[0]["code"] == "unauthorized" and errors[0]["fatal"] is True
    assert "token" in errors[0]["message"]
    assert p.locator(ALERT).inner_text() == errors[0]["message"]

    # a token function that says "unauthorized" (e.g. signed out) stops the widget too
    p.evaluate(
        """() => { document.querySelector('tokenrelay-chat').token = async () => {
             throw Object.assign(new Error('signed out'), { code: 'unauthorized' }); }; }"""
    )
    p.wait_for_function("() => window.__errors.length === 2")
    assert p.evaluate("() => window.__errors[1]") == {
        "code": "unauthorized",
        "message": "signed out",
        "source": "connection",
        "fatal": True,
    }
    p.wait_for_selector(CONN + "[data-state=closed]")
