"""The official ``openai`` npm package in Chromium, on another origin than the gateway.

The most common setup of a frontend developer: a dev server (here a Python
``http.server`` on ``127.0.0.1:<other port>``, a different origin from the gateway's
``127.0.0.1:<port>``) serves a page that imports the SDK's ES module build
(``node_modules/openai/index.mjs`` and its relative imports, served from
tests/js/ by that same host server, no bundler and no import map) and calls the
gateway with ``dangerouslyAllowBrowser: true``. The SDK sends ``x-stainless-*``
headers, so every call is preceded by a CORS preflight that must allow them (before
the gateway echoed requested headers, Chromium blocked the first call: "Request
header field x-stainless-os is not allowed by Access-Control-Allow-Headers").

Loopback pages (any port) are allowed by the gateway's default origin policy, so the
session's ``tokenrelay serve`` (tests/web/conftest.py) needs no ``--allow-origin``.
The second test puts the page on 127.0.0.2, which is not a local name: the ``serve``
gateway refuses it, and the conftest's ``keyed_gateway`` (``--allow-origin`` for it,
``--api-keys``, sharing the serve's Redis and worker) serves it, the key going in
``Authorization``.

The scenario (tests/js/openai_sdk_checks.mjs, shared with the Node run of
tests/gateway/http/test_sdk_js.py): a completion, a stream read to the end, an abort
while waiting for the answer (``APIUserAbortError``), and an abort after the first
chunks of a long stream, which the gateway sees as a disconnect; the page then cancels
the stream with its resume token and reads it back, ending in ``cancelled``.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.root import ROOT
from tests.web.conftest import KeyedGateway, Server, _open_page

JS_DIR = ROOT / "tests" / "js"
SDK = JS_DIR / "node_modules" / "openai" / "index.mjs"

HOST_PAGE = b"""<!doctype html>
<meta charset="utf-8">
<link rel="icon" href="data:,">
<title>openai SDK on another origin</title>
<script type="module">
import OpenAI from "/node_modules/openai/index.mjs";
import { runChecks } from "/openai_sdk_checks.mjs";
window.runChecks = async (baseURL, apiKey) => {
  try {
    return await runChecks(OpenAI, { baseURL, apiKey, browser: true });
  } catch (err) {
    return { failed: `${err?.constructor?.name}: ${err?.message}` };
  }
};
document.title = "ready";
</script>
"""


class HostPage(SimpleHTTPRequestHandler):
    """The host site: ``/`` is the page, everything else a file of tests/js/."""

    extensions_map = {**SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript"}

    def do_GET(self) -> None:
        if self.path in ("/", "/index.html"):
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(HOST_PAGE)))
            self.end_headers()
            self.wfile.write(HOST_PAGE)
            return
        super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class SdkSite:
    """A host site serving the page and tests/js/ on ``host:port`` (0: a free port)."""

    def __init__(self, host: str, port: int = 0) -> None:
        handler = partial(HostPage, directory=str(JS_DIR))
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self.origin = f"http://{host}:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


@pytest.fixture(scope="module")
def host_site() -> Iterator[SdkSite]:
    """The dev server of the common setup: loopback, another port than the gateway."""
    if not SDK.exists():
        pytest.skip("tests/js/node_modules/openai is missing: run make js")
    site = SdkSite("127.0.0.1")
    try:
        yield site
    finally:
        site.stop()


def disconnects(base: str) -> float:
    """The gateway's ``tokenrelay_disconnects_total`` (clients that left a stream)."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith("tokenrelay_disconnects_total "):
            return float(line.split()[1])
    raise AssertionError("no tokenrelay_disconnects_total in /metrics")


@dataclass
class PageRun:
    out: dict[str, Any]
    cors: list[str]  # console lines about CORS (Chromium says why it blocked a request)
    errors: list[str]  # console errors and page errors


def run_in_page(browser: Any, site: SdkSite, base: str, api_key: str = "unused") -> PageRun:
    """Open the host page and run the scenario against the gateway at ``base``."""
    h = _open_page(browser, viewport={"width": 800, "height": 600})
    try:
        h.page.goto(site.origin + "/")
        h.page.wait_for_function("document.title === 'ready'")
        out = h.page.evaluate("([b, k]) => window.runChecks(b, k)", [base + "/v1", api_key])
        return PageRun(out, [t for _, t in h.console if "CORS" in t], h.console_errors())
    finally:
        h.context.close()


def check_scenario(run: PageRun) -> None:
    out = run.out
    assert "failed" not in out, f"{out['failed']}; console: {run.cors}"
    assert run.cors == [] and run.errors == [], (run.cors, run.errors)
    full = out["full"]
    assert full["object"] == "chat.completion" and full["text"]
    assert full["requestId"] and full["streamId"]  # exposed headers are readable
    assert out["stream"]["text"] and out["stream"]["finishes"] in (["stop"], ["length"])
    assert out["early"] == {"error": "APIUserAbortError", "isAbortError": True}
    abort = out["abort"]
    # openai 6.x ends the `for await` loop quietly when the signal fires mid-stream
    assert abort["error"] is None and abort["signalAborted"] and not abort["finished"]
    assert abort["contentChunks"] >= 2 and abort["hasToken"]
    assert abort["cancel"]["status"] == 200
    assert abort["cancel"]["state"] == "cancelling"  # still generating after the abort
    assert abort["replay"] == {"status": 200, "finishes": ["cancelled"], "done": True}


def wait_for_disconnect(base: str, before: float) -> None:
    deadline = time.monotonic() + 10  # the gateway saw the aborted fetch as a disconnect
    while disconnects(base) < before + 1:
        assert time.monotonic() < deadline, "the gateway never saw the aborted stream go"
        time.sleep(0.2)


def test_openai_sdk_streams_and_aborts_from_another_origin(
    browser: Any, server: Server, host_site: SdkSite
) -> None:
    assert host_site.origin != server.base  # same host, another port: another origin
    before = disconnects(server.base)
    check_scenario(run_in_page(browser, host_site, server.base))
    wait_for_disconnect(server.base, before)


def test_openai_sdk_on_a_listed_origin_with_a_key(
    browser: Any, server: Server, keyed_gateway: KeyedGateway
) -> None:
    """A page on 127.0.0.2 (not a local name): refused by a gateway without
    ``--allow-origin`` for it, served by one that lists it, with the API key in
    ``Authorization`` (which the preflight allows next to the SDK's headers)."""
    if not SDK.exists():
        pytest.skip("tests/js/node_modules/openai is missing: run make js")
    host, port = keyed_gateway.allowed_origin.removeprefix("http://").rsplit(":", 1)
    site = SdkSite(host, int(port))
    try:
        refused = run_in_page(browser, site, server.base)
        assert refused.out == {"failed": "APIConnectionError: Connection error."}, refused.out
        assert any("blocked by CORS policy" in t for t in refused.cors), refused.cors
        before = disconnects(keyed_gateway.base)
        check_scenario(run_in_page(browser, site, keyed_gateway.base, keyed_gateway.key))
        wait_for_disconnect(keyed_gateway.base, before)
    finally:
        site.stop()
