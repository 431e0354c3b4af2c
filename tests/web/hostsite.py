"""Somebody else's website, for the widget's cross-origin tests: pages plus a tiny backend.

It listens on 127.0.0.2 (not one of the gateway's always-allowed local names, so the
gateway must list it with ``--allow-origin``) and serves:

- the pages a test registers, with the Content-Security-Policy the test sets;
- ``GET /token``: mints a WebSocket token by calling the gateway's ``POST /v1/ws-token``
  with the API key, which stays on this server; the browser only ever sees the token.
  ``fail_next`` makes the next requests answer 500, and ``token_times`` records when each
  request came (monotonic seconds), so a test can see retries and their backoff.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class HostSite:
    """A ``ThreadingHTTPServer`` in a thread; ``stop()`` shuts it down."""

    def __init__(self, host: str, port: int, gateway: str, api_key: str) -> None:
        self.origin = f"http://{host}:{port}"
        self.gateway = gateway
        self.api_key = api_key
        self.pages: dict[str, str] = {}
        self.csp = ""
        self.fail_next = 0
        self.token_times: list[float] = []
        self._lock = threading.Lock()
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/token":
                    site._token(self)
                elif path in site.pages:
                    headers = {"Content-Type": "text/html; charset=utf-8"}
                    if site.csp:
                        headers["Content-Security-Policy"] = site.csp
                    _send(self, 200, site.pages[path].encode(), headers)
                else:
                    _send(self, 404, b"not found", {"Content-Type": "text/plain"})

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def _token(self, handler: BaseHTTPRequestHandler) -> None:
        """The whole "backend" a host site needs: trade the key for a short-lived token."""
        with self._lock:
            self.token_times.append(time.monotonic())
            fail = self.fail_next > 0
            self.fail_next -= 1 if fail else 0
        if fail:
            _send(handler, 500, b'{"error": "down"}', {"Content-Type": "application/json"})
            return
        req = urllib.request.Request(
            self.gateway + "/v1/ws-token",
            method="POST",
            headers={"Authorization": f"Bearer {self.api_key}"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            token = json.load(resp)["token"]
        body = json.dumps({"token": token}).encode()
        headers = {"Content-Type": "application/json", "Cache-Control": "no-store"}
        _send(handler, 200, body, headers)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def _send(
    handler: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str]
) -> None:
    handler.send_response(status)
    for name, value in headers.items():
        handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
