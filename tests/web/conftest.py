"""Browser-test fixtures: a real ``tokenrelay serve`` and Debian's Chromium through Playwright.

``TOKENRELAY_TEST_SERVER=http://127.0.0.1:8000`` runs the tests against a gateway that is
already running instead of starting one.

Everything here is session-scoped except the page: one server (embedded Redis, one engine
worker with the default model, the gateway on a free port) and one Chromium for the whole
run, a fresh browser context (empty localStorage) per test. The tests skip, with the reason,
when /usr/bin/chromium, Playwright or the prepared default model is missing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
from tests.root import ROOT  # noqa: E402

READY_TIMEOUT_S = float(os.environ.get("TOKENRELAY_TEST_READY_TIMEOUT", "240"))


# A test that uses one of these (directly or through another fixture, e.g. `desktop`) needs
# Chromium or a running `tokenrelay serve`: it is marked `browser`, which `make test-fast`
# deselects. The rest of tests/web (the JS client's node tests, the npm package, the layout
# of static/) runs there too.
BROWSER_FIXTURES = frozenset({"browser", "server", "keyed_gateway"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here not in Path(str(item.fspath)).parents:
            continue
        if BROWSER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.browser)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


@dataclass
class Server:
    base: str
    proc: subprocess.Popen[bytes] | None
    log_path: Path
    references: dict[tuple[str, int], str] = field(default_factory=dict)
    _long_max: int | None = None

    @property
    def ws_url(self) -> str:
        return self.base.replace("http://", "ws://") + "/v1/ws"

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # --- a protocol client independent of the JS code under test ------------------------

    def run(self, frames: list[dict[str, Any]], *, until: str = "done") -> list[dict[str, Any]]:
        """Send frames on a fresh socket and collect server frames until one of type ``until``."""
        from websockets.sync.client import connect

        out: list[dict[str, Any]] = []
        with connect(self.ws_url, open_timeout=10, max_size=None) as ws:
            for f in frames:
                ws.send(json.dumps(f))
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                frame = json.loads(ws.recv(timeout=60))
                out.append(frame)
                if frame["type"] in (until, "error"):
                    return out
        raise AssertionError(f"no {until!r} frame; got {out[-5:]}")

    def long_max_tokens(self, question: str) -> int:
        """A ``max_tokens`` that keeps an answer streaming for several seconds on this machine
        (64 on a busy CPU, more on a GPU), so a test can cut the network mid-answer."""
        if self._long_max is None:
            t0 = time.monotonic()
            frames = self.run(
                [
                    {
                        "type": "generate",
                        "request_id": "probe",
                        "messages": [{"role": "user", "content": question}],
                        "params": {"temperature": 0, "max_tokens": 16, "ignore_eos": True},
                    }
                ]
            )
            rate = 16 / max(time.monotonic() - t0, 1e-3)
            assert frames[-1]["type"] == "done", frames[-3:]
            self._long_max = int(min(1024, max(64, rate * 6)))
        return self._long_max

    def reference(self, question: str, max_tokens: int) -> str:
        """The uninterrupted greedy answer to ``question`` (cached), as the page asks it."""
        key = (question, max_tokens)
        if key not in self.references:
            frames = self.run(
                [
                    {
                        "type": "generate",
                        "request_id": "reference",
                        "messages": [{"role": "user", "content": question}],
                        "params": {"temperature": 0, "max_tokens": max_tokens, "top_p": 1},
                    }
                ]
            )
            assert frames[-1]["type"] == "done", frames[-3:]
            tokens = sorted((f for f in frames if f["type"] == "token"), key=lambda f: f["seq"])
            assert [f["seq"] for f in tokens] == list(range(1, len(tokens) + 1))
            self.references[key] = "".join(f["text"] for f in tokens)
        return self.references[key]


def _model_prepared() -> bool:
    try:
        from tokenrelay.engine.models.store import list_cached
    except ImportError:
        return False
    try:
        return bool(list_cached())
    except Exception:
        return False


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    external = os.environ.get("TOKENRELAY_TEST_SERVER")
    if external:  # reuse a running gateway (e.g. `tokenrelay serve --port 8765`)
        status, body = _get(external.rstrip("/") + "/readyz", timeout=10)
        if status != 200:
            pytest.fail(f"TOKENRELAY_TEST_SERVER={external} is not ready: {status} {body}")
        yield Server(external.rstrip("/"), None, Path("/dev/null"))
        return
    if not _model_prepared():
        pytest.skip("the default model is not prepared: run `make model`")
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    env.setdefault("TOKENRELAY_LOG_FORMAT", "json")
    data_dir = tmp_path_factory.mktemp("redis")  # never share a running `make run`'s Redis
    cmd = [
        sys.executable,
        "-m",
        "tokenrelay.core.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    cmd += ["--data-dir", str(data_dir)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    srv = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tokenrelay serve exited with {proc.returncode}:\n{srv.log_tail()}")
            try:
                status, _ = _get(srv.base + "/readyz")
            except OSError:
                status = 0
            if status == 200:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"tokenrelay serve not ready in {READY_TIMEOUT_S}s:\n{srv.log_tail()}")
            time.sleep(0.5)
        yield srv
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # like Ctrl+C: stops gateway, worker and Redis
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    """Chromium for this package only: Playwright's sync API keeps an event loop running
    on the main thread while it is open, which would break every later asyncio test."""
    if not CHROMIUM.exists():
        pytest.skip("/usr/bin/chromium is missing: run `make browser` (Debian's chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright Python package is not installed")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@dataclass
class PageHandle:
    """A page plus what it logged."""

    page: Any
    context: Any
    console: list[tuple[str, str]]
    errors: list[str]

    def console_errors(self, *, allow: tuple[str, ...] = ()) -> list[str]:
        bad = [text for kind, text in self.console if kind == "error"] + self.errors
        return [t for t in bad if not any(a in t for a in allow)]


def _open_page(browser: Any, **context_args: Any) -> PageHandle:
    context = browser.new_context(**context_args)
    page = context.new_page()
    console: list[tuple[str, str]] = []
    errors: list[str] = []
    page.on("console", lambda m: console.append((m.type, m.text)))
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.set_default_timeout(30_000)
    return PageHandle(page, context, console, errors)


@pytest.fixture
def desktop(browser: Any, server: Server) -> Iterator[PageHandle]:
    h = _open_page(browser, viewport={"width": 1280, "height": 800})
    try:
        yield h
    finally:
        h.context.close()


@pytest.fixture
def phone(browser: Any, server: Server) -> Iterator[PageHandle]:
    h = _open_page(
        browser,
        viewport={"width": 390, "height": 844},
        device_scale_factor=2,
        is_mobile=True,
        has_touch=True,
    )
    try:
        yield h
    finally:
        h.context.close()


@pytest.fixture(scope="session")
def screenshot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """docs/screenshots when TOKENRELAY_SCREENSHOTS=1 (to refresh the docs), else a temp dir."""
    if os.environ.get("TOKENRELAY_SCREENSHOTS") == "1":
        out = ROOT / "docs" / "screenshots"
        out.mkdir(parents=True, exist_ok=True)
        return out
    return tmp_path_factory.mktemp("screenshots")


@dataclass
class KeyedGateway:
    """A gateway with API keys that lets one foreign origin in (``--allow-origin``)."""

    base: str
    key: str
    allowed_origin: str  # http://127.0.0.2:<port>: the port is free for the test's host site
    proc: Any


@pytest.fixture(scope="session")
def keyed_gateway(
    server: Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KeyedGateway]:
    """A second gateway, with ``--api-keys`` and ``--allow-origin``, on the ``server``
    fixture's Redis: it shares that engine worker, so it costs one gateway process (a couple
    of seconds), not a second model."""
    from tests.gateway.procs import Proc, wait_ready

    if server.proc is None:
        pytest.skip("needs the Redis of a server the tests start (not TOKENRELAY_TEST_SERVER)")
    redis_url = next(
        (
            rec["redis"]
            for line in server.log_path.read_text(errors="replace").splitlines()
            if line.startswith("{") and (rec := json.loads(line)).get("msg") == "serving"
        ),
        None,
    )
    if not redis_url:
        pytest.fail(f"no 'serving' line with the Redis URL in the serve log:\n{server.log_tail()}")
    with socket.socket() as s:  # a port for the host site on 127.0.0.2 (not a local name)
        s.bind(("127.0.0.2", 0))
        origin = f"http://127.0.0.2:{s.getsockname()[1]}"
    key = "sk-widget-test-0123456789"
    port = _free_port()
    args = ["gateway", "--redis-url", redis_url, "--port", str(port)]
    args += ["--api-keys", key, "--allow-origin", origin]
    proc = Proc(args, tmp_path_factory.mktemp("keyed") / "gateway.log")
    try:
        wait_ready(f"127.0.0.1:{port}", proc, 60)
        yield KeyedGateway(f"http://127.0.0.1:{port}", key, origin, proc)
    finally:
        proc.stop()
