"""The chat page's polish, in Chromium against a real ``tokenrelay serve``: highlighted code
under the sanitiser, editing a message and regenerating any answer, the one live region,
the model and worker readiness in the header, and the keyboard shortcuts."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import tomllib
from collections.abc import Iterator
from typing import Any

import pytest

from tests.root import ROOT
from tests.web.conftest import PageHandle, Server, _get, _open_page
from tests.web.test_chat import (
    ASSISTANT,
    SHORT_Q,
    ask,
    open_chat,
    user_message_texts,
    wait_finished,
)
from tests.web.test_readiness import bare_gateway  # noqa: F401  (a fixture)
from tokenrelay.worker.store import WorkerStore

pytestmark = pytest.mark.browser

USER = "[data-testid=message][data-role=user]"
# The classes the page itself puts inside an answer (code block frame, streaming caret).
UI_CLASSES = {"code-block", "code-bar", "code-lang", "code-copy", "caret", "error-text"}
ALLOWED_CLASS_JS = "/^(hljs|hljs-[a-z0-9_-]+|language-[A-Za-z0-9_+#.-]+)$/"


def seed_conversation(page: Any, messages: list[dict[str, Any]], conv_id: str = "cseed") -> None:
    """Store a conversation in localStorage and reload the page to show it."""
    conv = {
        "id": conv_id,
        "title": "seeded",
        "createdAt": 1,
        "updatedAt": 1,
        "messages": [{"createdAt": 1, "state": "done", **m} for m in messages],
    }
    page.evaluate(
        "c => { localStorage.setItem('tokenrelay.v1.conversations',"
        " JSON.stringify({order: [c.id], items: {[c.id]: c}}));"
        " localStorage.setItem('tokenrelay.v1.current', JSON.stringify(c.id)); }",
        conv,
    )
    page.reload()
    page.wait_for_selector("[data-testid=connection][data-state=open]")


def record_generates(page: Any) -> list[dict[str, Any]]:
    """The ``generate`` frames the page sends from now on."""
    sent: list[dict[str, Any]] = []

    def on_ws(ws: Any) -> None:
        def on_frame(payload: Any) -> None:
            frame = json.loads(payload)
            if frame.get("type") == "generate":
                sent.append(frame)

        ws.on("framesent", on_frame)

    page.on("websocket", on_ws)
    return sent


def stored_messages(page: Any) -> list[dict[str, Any]]:
    return list(
        page.evaluate(
            "() => { const c = window.tokenrelay.conversations;"
            " return c.items[c.order[0]].messages.map(m => ({role: m.role, content: m.content})); }"
        )
    )


# --- syntax highlighting under the sanitiser --------------------------------------------------


def test_the_highlighter_ships_in_the_wheel_and_is_served() -> None:
    """Every file static/highlight.js imports and every theme index.html links is in
    static/vendor/, pinned by its sha256 in VERSIONS, covered by pyproject's data-files
    and served."""
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from tokenrelay.gateway.http.pages import page_routes

    imported = re.findall(r'from "\./(vendor/[^"]+)"', (ROOT / "static/highlight.js").read_text())
    themes = re.findall(
        r'/(vendor/highlight[^"?]+\.css)', (ROOT / "web/templates/index.html").read_text()
    )
    assert len(imported) == 13 and len(themes) == 2, (imported, themes)
    versions = (ROOT / "static/vendor/VERSIONS").read_text()
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    shipped = [
        g
        for dest, files in globs.items()
        if dest.startswith("share/tokenrelay/static")
        for g in files
    ]
    client = TestClient(Starlette(routes=page_routes()))
    for name in ["highlight.js", *imported, *themes, "vendor/LICENSE.highlight"]:
        path = f"static/{name}"
        assert (ROOT / path).is_file(), path
        assert any(fnmatch.fnmatch(path, g) for g in shipped), f"{path} is not in the wheel"
        if name.startswith("vendor/highlight."):  # pinned: its sha256 is in VERSIONS
            assert hashlib.sha256((ROOT / path).read_bytes()).hexdigest() in versions, path
        r = client.get(f"/{path}")
        assert r.status_code == 200, path
        if name.endswith(".js"):
            assert "javascript" in r.headers["content-type"], path
        if name.endswith(".css"):
            assert r.headers["content-type"].startswith("text/css"), path


CRAFTED = (
    "Some code:\n\n"
    "```python\ndef square(x):\n    return x ** 2  # <b>not bold</b>\n```\n\n"
    '<span class="evil hljs-keyword" style="color:red" onclick="window.__xss=1">span</span>\n\n'
    '<code class="hljs language-python x" onmouseover="window.__xss=2">code</code>\n\n'
    "```\nno language\n```\n\n"
    "```brainfuck\n+[>+<-]\n```\n"
)


def test_code_is_highlighted_and_only_highlighter_classes_survive(
    desktop: PageHandle, server: Server
) -> None:
    page = open_chat(desktop, server)
    seed_conversation(
        page,
        [
            {"id": "u1", "role": "user", "content": "Show me code."},
            {"id": "a1", "role": "assistant", "content": CRAFTED},
        ],
    )
    answer = page.locator(ASSISTANT).last.locator("[data-testid=message-content]")
    # the fenced python block is highlighted
    code = answer.locator("pre code").first
    assert code.get_attribute("class") == "hljs language-python"
    assert code.get_attribute("data-lang") == "python"
    assert answer.locator("pre code span.hljs-keyword").first.inner_text() == "def"
    assert answer.locator("pre code span.hljs-number").first.inner_text() == "2"
    assert "<b>not bold</b>" in code.inner_text()  # the code's own markup is text
    assert answer.locator("b").count() == 0
    # themed: the keyword has a colour of its own
    colours = page.evaluate(
        "() => { const c = document.querySelector('pre code.hljs');"
        " return [getComputedStyle(c.querySelector('.hljs-keyword')).color,"
        " getComputedStyle(c).color]; }"
    )
    assert colours[0] != colours[1]
    # blocks without a known language stay plain (no classes)
    blocks = answer.locator("pre code")
    assert blocks.count() == 3
    assert blocks.nth(1).get_attribute("class") is None
    assert blocks.nth(2).get_attribute("class") is None
    assert blocks.nth(2).get_attribute("data-lang") == "brainfuck"
    # the crafted raw HTML shows as text, and nothing in the answer has another class, a
    # style or a handler
    text = answer.inner_text()
    assert '<span class="evil hljs-keyword" style="color:red"' in text
    bad = page.evaluate(
        "([allowed, ui]) => { const re = new RegExp(allowed.slice(1, -1));"
        " const out = [];"
        " const all = document.querySelectorAll('#messages [data-testid=message-content] *');"
        " for (const el of all) {"
        "   for (const c of el.classList) if (!re.test(c) && !ui.includes(c)) out.push(c);"
        "   for (const a of el.attributes) if (a.name === 'style' || a.name.startsWith('on'))"
        "     out.push(a.name);"
        " } return out; }",
        [ALLOWED_CLASS_JS, sorted(UI_CLASSES)],
    )
    assert bad == []
    page.wait_for_timeout(200)
    assert page.evaluate("() => window.__xss") is None
    assert desktop.console_errors() == []


def test_the_sanitiser_keeps_only_highlighter_classes(desktop: PageHandle, server: Server) -> None:
    """Hostile markup straight into the sanitiser (model text never reaches it as HTML: this
    checks the class rule itself)."""
    page = open_chat(desktop, server)
    html = page.evaluate(
        """async (src) => {
          const m = await import('/static/markdown.js');
          const box = document.createElement('div');
          box.append(m.sanitize(src));
          return box.innerHTML;
        }""",
        '<pre><code class="hljs language-python evil" style="color:red" onclick="x()">'
        '<span class="hljs-keyword bad" style="font-size:99px" onmouseover="y()">def</span>'
        '<span class="evil">z</span><span class="hljs-title function_">f</span></code></pre>'
        '<p class="hljs">p</p><div class="hljs-keyword" style="position:fixed">d</div>'
        '<a class="language-js" href="https://example.com/">a</a>',
    )
    assert html == (
        '<pre><code class="hljs language-python">'
        '<span class="hljs-keyword">def</span><span>z</span>'
        '<span class="hljs-title">f</span></code></pre>'
        "<p>p</p><div>d</div>"
        '<a href="https://example.com/" target="_blank" rel="noopener noreferrer nofollow">a</a>'
    )
    # parsing the style attributes is itself refused by the page's CSP (style-src 'self')
    assert desktop.console_errors(allow=("Content Security Policy",)) == []


# --- edit and regenerate ----------------------------------------------------------------------


def test_edit_a_message_and_regenerate_any_answer(desktop: PageHandle, server: Server) -> None:
    page = desktop.page
    sent = record_generates(page)
    open_chat(desktop, server, "?temperature=0&max_tokens=8")
    ask(page, "Name a colour.")
    assert wait_finished(page) == "done"
    ask(page, "Name another one.")
    assert wait_finished(page) == "done"
    assert page.locator(ASSISTANT).count() == 2
    first_answer = stored_messages(page)[1]["content"]

    # regenerate the first answer: it and everything after it are replaced
    page.locator(ASSISTANT).first.locator("[data-testid=regenerate]").click()
    assert wait_finished(page) == "done"
    assert user_message_texts(page) == ["Name a colour."]
    assert page.locator(ASSISTANT).count() == 1
    assert sent[-1]["messages"] == [{"role": "user", "content": "Name a colour."}]
    assert stored_messages(page)[1]["content"] == first_answer  # greedy: the same answer

    # edit the user message: Esc cancels and gives focus back to the Edit button
    page.locator(USER).first.locator("[data-testid=edit]").click()
    box = page.locator("[data-testid=edit-box]")
    assert box.input_value() == "Name a colour."
    assert page.evaluate("() => document.activeElement.dataset.testid") == "edit-box"
    box.fill("Something else")
    box.press("Escape")
    assert page.locator("[data-testid=editor]").count() == 0
    assert user_message_texts(page) == ["Name a colour."]
    assert page.evaluate("() => document.activeElement.dataset.testid") == "edit"

    # edit again and save with Enter: the conversation after it is replaced
    page.locator(USER).first.locator("[data-testid=edit]").click()
    box.fill("Name a fruit.")
    box.press("Enter")
    assert wait_finished(page) == "done"
    assert user_message_texts(page) == ["Name a fruit."]
    assert page.locator(ASSISTANT).count() == 1
    assert sent[-1]["messages"] == [{"role": "user", "content": "Name a fruit."}]
    assert sent[-1]["params"]["max_tokens"] == 8
    stored = stored_messages(page)
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert stored[0]["content"] == "Name a fruit."
    assert page.locator("[data-testid=conversation]").inner_text() == "Name a fruit."
    assert len(sent) == 4
    # survives a reload
    page.reload()
    page.wait_for_selector(ASSISTANT)
    assert user_message_texts(page) == ["Name a fruit."]
    assert desktop.console_errors() == []


def test_edit_and_regenerate_wait_for_the_answer_in_progress(
    desktop: PageHandle, server: Server
) -> None:
    page = open_chat(desktop, server, "?temperature=0&max_tokens=8")
    ask(page, SHORT_Q)
    page.wait_for_selector(ASSISTANT + "[data-state=streaming]")
    # while an answer streams, the other messages offer neither Edit nor Regenerate
    assert page.locator(USER).first.locator("[data-testid=edit]").is_hidden()
    assert wait_finished(page) == "done"
    assert page.locator(USER).first.locator("[data-testid=edit]").is_visible()
    assert page.locator(ASSISTANT).first.locator("[data-testid=regenerate]").is_visible()
    assert desktop.console_errors() == []


# --- one live region --------------------------------------------------------------------------


def test_one_live_region_reads_each_finished_answer_once(
    desktop: PageHandle, server: Server
) -> None:
    page = open_chat(desktop, server, "?temperature=0&max_tokens=16")
    live = page.evaluate(
        "() => [...document.querySelectorAll('[aria-live]')].map(e => e.id || e.dataset.testid)"
    )
    assert live == ["connection", "announcer"]  # the connection status and the answers' region
    announcer = page.locator("#announcer")
    assert announcer.get_attribute("aria-live") == "polite"
    assert announcer.get_attribute("class") == "visually-hidden"
    page.evaluate(
        "() => { window.__said = [];"
        " new MutationObserver(() => { const t = document.getElementById('announcer').textContent;"
        " if (t) window.__said.push(t); }).observe(document.getElementById('announcer'),"
        " {childList: true, characterData: true, subtree: true}); }"
    )
    ask(page, SHORT_Q)
    assert wait_finished(page) == "done"
    page.wait_for_function("() => window.__said.length === 1")
    # finishing the second answer leaves the first one's nodes alone
    page.evaluate(
        f"() => {{ const first = document.querySelector('{ASSISTANT}');"
        " window.__firstMutations = 0; window.__firstNode = first.querySelector("
        "'[data-testid=message-content]').firstChild;"
        " new MutationObserver((records) => { window.__firstMutations += records.length; })"
        ".observe(first, {subtree: true, childList: true, characterData: true, attributes: true});"
        " }"
    )
    ask(page, "And the capital of Italy?")
    assert wait_finished(page) == "done"
    page.wait_for_function("() => window.__said.length === 2")
    page.wait_for_timeout(300)
    said = page.evaluate("() => window.__said")
    answers = page.eval_on_selector_all(
        ASSISTANT + " [data-testid=message-content]",
        "els => els.map(e => e.textContent.replace(/\\s+/g, ' ').trim())",
    )
    assert said == [f"Answer: {answers[0]}", f"Answer: {answers[1]}"]
    assert page.evaluate("() => window.__firstMutations") == 0
    assert page.evaluate(
        f"() => document.querySelector('{ASSISTANT} [data-testid=message-content]').firstChild"
        " === window.__firstNode"
    )
    # no message is a live region, while streaming or after
    assert page.locator("#messages [aria-live]").count() == 0
    assert (
        page.locator(ASSISTANT)
        .last.locator("[data-testid=message-content]")
        .get_attribute("aria-busy")
        == "false"
    )
    assert desktop.console_errors() == []


# --- header: model and worker readiness -------------------------------------------------------


def test_header_shows_the_model_and_a_ready_worker(desktop: PageHandle, server: Server) -> None:
    page = open_chat(desktop, server)
    status, body = _get(server.base + "/v1/models")
    assert status == 200
    model_id = json.loads(body)["data"][0]["id"]
    page.wait_for_function(
        "id => document.querySelector('[data-testid=model-name]').textContent === id", arg=model_id
    )
    chip = page.locator("[data-testid=model]")
    assert chip.get_attribute("data-ready") == "true"
    assert page.locator("[data-testid=worker-state]").inner_text() == "ready"
    assert chip.is_visible()
    # read as one phrase by a screen reader
    assert " ".join(chip.text_content().split()) == f"Model: {model_id} , worker: ready"
    assert desktop.console_errors() == []


@pytest.fixture
def loading_page(browser: Any, bare_gateway: tuple[str, WorkerStore]) -> Iterator[Any]:  # noqa: F811
    addr, _ = bare_gateway
    h = _open_page(browser, viewport={"width": 1280, "height": 800})
    try:
        h.page.goto(f"http://{addr}/")
        yield h
    finally:
        h.context.close()


def test_header_says_the_worker_is_loading_until_it_is_ready(
    loading_page: PageHandle,
    bare_gateway: tuple[str, WorkerStore],  # noqa: F811
) -> None:
    from tokenrelay.core.wire.stats import WorkerStats

    page = loading_page.page
    page.wait_for_selector("[data-testid=model][data-ready=false]")
    assert page.locator("[data-testid=worker-state]").inner_text() == "loading"
    page.wait_for_function(
        "() => document.querySelector('[data-testid=model-name]').textContent === 'default'"
    )
    bare_gateway[1].heartbeat(WorkerStats())  # the worker has loaded its model
    page.wait_for_selector("[data-testid=model][data-ready=true]", timeout=10_000)
    assert page.locator("[data-testid=worker-state]").inner_text() == "ready"
    assert loading_page.console_errors() == []


# --- keyboard shortcuts -----------------------------------------------------------------------


def focused(page: Any) -> str:
    return str(page.evaluate("() => document.activeElement?.dataset.testid ?? ''"))


def test_shortcuts_focus_the_composer_and_start_a_new_chat(
    desktop: PageHandle, server: Server
) -> None:
    page = open_chat(desktop, server, "?temperature=0&max_tokens=4")
    hints = page.locator("[data-testid=shortcuts]")
    assert hints.is_visible()
    for key in ("Ctrl", "Shift", "O", "/", "Esc"):
        assert key in hints.inner_text()
    # `/` focuses the message box from anywhere but a text field, and is not typed
    page.locator("[data-testid=settings-toggle]").focus()
    page.keyboard.press("/")
    assert focused(page) == "composer"
    assert page.input_value("[data-testid=composer]") == ""
    page.keyboard.type("a/b")  # inside the box `/` is just a character
    assert page.input_value("[data-testid=composer]") == "a/b"
    page.fill("[data-testid=composer]", "")
    # Shift+Esc too
    page.locator("[data-testid=new-chat]").focus()
    page.keyboard.press("Shift+Escape")
    assert focused(page) == "composer"
    # Ctrl+Shift+O starts a new chat (from the box, too)
    ask(page, "Hi")
    wait_finished(page)
    assert page.locator("[data-testid=conversation]").count() == 1
    page.locator("[data-testid=composer]").focus()
    page.keyboard.press("Control+Shift+O")
    page.wait_for_function(
        "() => document.querySelectorAll('[data-testid=conversation]').length === 2"
    )
    assert page.locator("[data-testid=message]").count() == 0
    assert focused(page) == "composer"
    # pressed again on an empty chat: no second empty conversation
    page.keyboard.press("Control+Shift+O")
    page.wait_for_timeout(100)
    assert page.locator("[data-testid=conversation]").count() == 2
    assert page.get_attribute("[data-testid=new-chat]", "aria-keyshortcuts") is not None
    assert desktop.console_errors() == []
