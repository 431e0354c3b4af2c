"""Before an engine worker is ready, the chat page and the widget say so and hold the send.

A real gateway with no worker on its own key prefix; a worker's heartbeat written
into Redis (as a worker does once its model is loaded) makes it ready. The pages
follow the gateway's hello and its notice.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.procs import start_gateway, stop_all, wait_ready
from tests.web.conftest import _open_page
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.worker.store import WorkerStore

CONN = "[data-testid=connection]"


@pytest.fixture
def bare_gateway(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[tuple[str, WorkerStore]]:
    prefix = f"ready-{uuid.uuid4().hex[:6]}:"
    gw, addr = start_gateway(redis_server.url, prefix, tmp_path)
    worker_store = WorkerStore(redis_server.url, "ui-worker", prefix=prefix)
    try:
        wait_ready(addr, gw, 60, need_worker=False)
        worker_store.ensure_group()
        yield addr, worker_store
    finally:
        stop_all([gw])
        worker_store.unregister()
        worker_store.close()


def _check_loading_then_ready(page: Any, scope: str, worker_store: WorkerStore) -> None:
    conn, send, box = (
        f"{scope}{CONN}",
        f"{scope}[data-testid=send]",
        f"{scope}[data-testid=composer]",
    )
    page.wait_for_selector(f"{conn}[data-state=loading]")
    assert "Loading model" in (page.text_content(conn) or "")
    assert page.is_disabled(send)
    page.fill(box, "Hello?")
    page.press(box, "Enter")  # held: the text stays, nothing is asked
    assert page.input_value(box) == "Hello?"
    assert page.locator(f"{scope}[data-testid=message]").count() == 0
    worker_store.heartbeat(WorkerStats())  # the worker has loaded its model
    page.wait_for_selector(f"{conn}[data-state=open]", timeout=10_000)
    assert page.is_enabled(send)


def test_chat_page_holds_the_send_until_a_worker_is_ready(
    browser: Any, bare_gateway: tuple[str, WorkerStore]
) -> None:
    addr, worker_store = bare_gateway
    h = _open_page(browser, viewport={"width": 1280, "height": 800})
    try:
        h.page.goto(f"http://{addr}/")
        _check_loading_then_ready(h.page, "", worker_store)
        assert not h.console_errors()
    finally:
        h.context.close()


def test_widget_holds_the_send_until_a_worker_is_ready(
    browser: Any, bare_gateway: tuple[str, WorkerStore]
) -> None:
    addr, worker_store = bare_gateway
    h = _open_page(browser, viewport={"width": 1280, "height": 800})
    try:
        h.page.goto(f"http://{addr}/embed-demo")
        h.page.click("tokenrelay-chat [data-testid=widget-launcher]")
        _check_loading_then_ready(h.page, "tokenrelay-chat ", worker_store)
        assert not h.console_errors()
    finally:
        h.context.close()
