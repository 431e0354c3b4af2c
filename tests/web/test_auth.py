"""The chat page against a gateway with API keys: it asks for the key, trades it for a token.

A gateway started with ``--api-keys`` (no engine worker needed: the test stops
at the connection). The page's first ``POST /v1/ws-token`` gets a 401, so it
asks for the key (a prompt dialog), keeps it in sessionStorage, fetches a
short-lived token and opens ``/v1/ws?token=...``. A wrong key leaves the page
disconnected (``closed``), and neither the key nor the token shows up in the
gateway's log.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.gateway.procs import Proc, start_gateway, wait_ready
from tests.web.conftest import _open_page
from tokenrelay.core.redis.embedded import EmbeddedRedis

KEY = "sk-browser-test-0123456789"


@pytest.fixture(scope="module")
def keyed(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Proc]]:
    logs = tmp_path_factory.mktemp("auth-ui-logs")
    gw, addr = start_gateway(redis_server.url, "authui:", logs, "--api-keys", KEY)
    try:
        wait_ready(addr, gw, 60, need_worker=False)
        yield f"http://{addr}", gw
    finally:
        gw.stop()


CONNECTED = "[data-testid=connection][data-state=loading]"


def test_chat_page_asks_for_the_key_and_connects(browser: Any, keyed: tuple[str, Proc]) -> None:
    base, gw = keyed
    h = _open_page(browser, viewport={"width": 1280, "height": 800})
    try:
        dialogs: list[str] = []

        def answer(d: Any) -> None:
            dialogs.append(d.message)
            d.accept(KEY)

        h.page.on("dialog", answer)
        h.page.goto(base + "/")
        # connected; no engine worker runs here, so the page says it is loading the model
        h.page.wait_for_selector(CONNECTED)
        assert len(dialogs) == 1 and "API key" in dialogs[0]
        assert h.page.evaluate("() => sessionStorage.getItem('tokenrelay.apiKey')") == KEY
        assert h.page.evaluate("() => localStorage.getItem('tokenrelay.apiKey')") is None
        h.page.reload()  # same tab: the key is remembered, no second question
        h.page.wait_for_selector(CONNECTED)
        assert len(dialogs) == 1
    finally:
        h.context.close()
    log = gw.log_text()
    assert "ws token issued" in log
    assert KEY not in log and "token=v1." not in log


def test_chat_page_with_a_wrong_key_stays_closed(browser: Any, keyed: tuple[str, Proc]) -> None:
    base, _ = keyed
    h = _open_page(browser, viewport={"width": 1280, "height": 800})
    try:
        h.page.on("dialog", lambda d: d.accept("sk-wrong"))
        h.page.goto(base + "/")
        h.page.wait_for_selector("[data-testid=connection][data-state=closed]")
    finally:
        h.context.close()
