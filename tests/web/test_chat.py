"""The chat page at ``/`` in Chromium against a real ``tokenrelay serve``.

The reconnect tests compare the page's final answer, character for character, with the same
question's uninterrupted greedy answer taken straight from the WebSocket API.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.web.conftest import PageHandle, Server

pytestmark = pytest.mark.browser

LONG_Q = "Write a long story about a lighthouse keeper who finds a robot on the beach."
STOP_MAX = 256  # answers that get stopped long before they end
SHORT_Q = "What is the capital of France?"
SHORT_MAX = 24
# What Chromium itself logs when a socket cannot connect during a network cut.
NETWORK_NOISE = ("WebSocket connection to", "ERR_INTERNET_DISCONNECTED", "net::ERR_")

ASSISTANT = "[data-testid=message][data-role=assistant]"
LAST_ASSISTANT_JS = "[...document.querySelectorAll('" + ASSISTANT + "')].at(-1)"


def open_chat(h: PageHandle, server: Server, query: str = "", path: str = "/") -> Any:
    page = h.page
    page.goto(server.base + path + query)
    page.wait_for_selector("[data-testid=connection][data-state=open]")
    return page


def ask(page: Any, text: str) -> None:
    page.fill("[data-testid=composer]", text)
    page.click("[data-testid=send]")


def wait_streaming_text(page: Any, min_chars: int = 20) -> None:
    page.wait_for_function(
        f"() => {{ const m = {LAST_ASSISTANT_JS};"
        " const c = m && m.querySelector('[data-testid=message-content]');"
        f" return m && m.dataset.state === 'streaming' && c.textContent.length >= {min_chars}; }}"
    )


def wait_finished(page: Any, timeout: float = 180_000) -> str:
    page.wait_for_function(
        f"() => {{ const m = {LAST_ASSISTANT_JS}; return m && m.dataset.state !== 'streaming'; }}",
        timeout=timeout,
    )
    return str(page.eval_on_selector_all(ASSISTANT, "els => els.at(-1).dataset.state"))


def last_answer_raw(page: Any) -> str:
    """The raw (Markdown) text of the last answer, as the page stored it."""
    return str(
        page.evaluate(
            "() => { const c = window.tokenrelay.conversations;"
            " const conv = c.items[c.order[0]]; return conv.messages.at(-1).content; }"
        )
    )


def user_message_texts(page: Any) -> list[str]:
    return list(
        page.eval_on_selector_all(
            "[data-testid=message][data-role=user] [data-testid=message-content]",
            "els => els.map(e => e.textContent)",
        )
    )


# --- streaming ------------------------------------------------------------------------------


def test_a_message_streams_in(desktop: PageHandle, server: Server) -> None:
    page = open_chat(desktop, server, f"?temperature=0&max_tokens={SHORT_MAX}")
    states: list[str] = []
    page.expose_function("recordState", lambda s: states.append(s))
    page.evaluate(
        "() => new MutationObserver(() => {"
        f" const m = {LAST_ASSISTANT_JS}; if (m) window.recordState(m.dataset.state);"
        " }).observe(document.getElementById('messages'), {subtree: true, childList: true,"
        " attributes: true, characterData: true})"
    )
    ask(page, SHORT_Q)
    assert wait_finished(page) == "done"
    assert "streaming" in states
    assert last_answer_raw(page) == server.reference(SHORT_Q, SHORT_MAX)
    assert user_message_texts(page) == [SHORT_Q]
    meta = page.locator(ASSISTANT).last.locator("[data-testid=message-meta]")
    assert meta.get_attribute("data-ttft-ms") is not None
    assert "TTFT" in meta.inner_text()
    # the finished answer is read once by the page's one live region (test_chat_polish.py);
    # the message itself is not a live region; and the composer has a label
    content = page.locator(ASSISTANT).last.locator("[data-testid=message-content]")
    assert content.get_attribute("aria-live") is None
    assert content.get_attribute("aria-busy") == "false"
    page.wait_for_function("() => document.getElementById('announcer').textContent !== ''")
    assert page.locator("#announcer").inner_text().startswith("Answer: ")
    assert page.get_by_label("Message", exact=True).get_attribute("data-testid") == "composer"
    assert desktop.console_errors() == []


def test_multi_turn_sends_the_history_and_survives_reload(
    desktop: PageHandle, server: Server
) -> None:
    page = desktop.page
    sent: list[dict[str, Any]] = []

    def on_ws(ws: Any) -> None:
        ws.on("framesent", lambda payload: sent.append(json.loads(payload)))

    page.on("websocket", on_ws)
    open_chat(desktop, server, "?temperature=0&max_tokens=12&system=Answer%20briefly.")
    ask(page, "Name a colour.")
    assert wait_finished(page) == "done"
    first_answer = last_answer_raw(page)
    ask(page, "Name another one.")
    assert wait_finished(page) == "done"
    generates = [f for f in sent if f["type"] == "generate"]
    assert len(generates) == 2
    assert generates[1]["messages"] == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "Name another one."},
    ]
    assert generates[1]["params"]["temperature"] == 0
    assert generates[1]["params"]["max_tokens"] == 12
    # an answer keeps generating for 5 minutes while the page is hidden (a locked phone)
    assert all(g["params"]["detach_timeout"] == 300 for g in generates)
    page.reload()
    page.wait_for_selector("[data-testid=connection][data-state=open]")
    assert user_message_texts(page) == ["Name a colour.", "Name another one."]
    assert page.locator("[data-testid=conversation]").count() == 1
    assert desktop.console_errors() == []


def test_enter_sends_and_shift_enter_adds_a_line(desktop: PageHandle, server: Server) -> None:
    page = open_chat(desktop, server, "?temperature=0&max_tokens=4")
    box = page.locator("[data-testid=composer]")
    box.click()
    box.type("first line")
    box.press("Shift+Enter")
    box.type("second line")
    assert box.input_value() == "first line\nsecond line"
    box.press("Enter")
    page.wait_for_selector("[data-testid=message][data-role=user]")
    assert user_message_texts(page) == ["first line\nsecond line"]
    assert box.input_value() == ""
    wait_finished(page)
    assert desktop.console_errors() == []


# --- reconnects -----------------------------------------------------------------------------


def test_network_cut_mid_answer_resumes_without_loss(desktop: PageHandle, server: Server) -> None:
    long_max = server.long_max_tokens(LONG_Q)
    expected = server.reference(LONG_Q, long_max)
    page = open_chat(desktop, server, f"?temperature=0&max_tokens={long_max}&debug=1")
    ask(page, LONG_Q)
    wait_streaming_text(page)
    desktop.context.set_offline(True)
    page.wait_for_selector("[data-testid=connection][data-state=offline]", timeout=10_000)
    assert page.locator(ASSISTANT).last.get_attribute("data-state") == "streaming"
    page.wait_for_timeout(1500)  # the server keeps generating meanwhile
    desktop.context.set_offline(False)
    assert wait_finished(page) == "done"
    assert last_answer_raw(page) == expected
    stats = page.evaluate("() => window.tokenrelay.client.stats")
    assert stats["resumes"] >= 1
    assert page.locator("[data-testid=debug-resumes]").inner_text() != "0"
    assert desktop.console_errors(allow=NETWORK_NOISE) == []


def test_drop_connection_button_resumes_without_loss(desktop: PageHandle, server: Server) -> None:
    long_max = server.long_max_tokens(LONG_Q)
    expected = server.reference(LONG_Q, long_max)
    page = open_chat(desktop, server, f"?temperature=0&max_tokens={long_max}&debug=1")
    ask(page, LONG_Q)
    wait_streaming_text(page)
    page.wait_for_function(
        "() => document.querySelector('[data-testid=debug-last-seq]').textContent !== '0'"
    )
    page.click("[data-testid=drop-connection]")
    page.wait_for_selector("[data-testid=connection][data-resumed=true]", timeout=15_000)
    assert page.locator("[data-testid=connection]").inner_text().strip() == "Resumed"
    wait_streaming_text(page, 1)  # still going after the resume
    page.click("[data-testid=drop-connection]")  # and once more
    assert wait_finished(page) == "done"
    assert last_answer_raw(page) == expected
    assert int(page.locator("[data-testid=debug-resumes]").inner_text()) >= 1
    assert page.evaluate("() => window.tokenrelay.client.stats.drops") == 2
    assert desktop.console_errors() == []


def test_reload_mid_answer_carries_on(desktop: PageHandle, server: Server) -> None:
    long_max = server.long_max_tokens(LONG_Q)
    expected = server.reference(LONG_Q, long_max)
    page = open_chat(desktop, server, f"?temperature=0&max_tokens={long_max}")
    ask(page, LONG_Q)
    wait_streaming_text(page, 30)
    saved = page.evaluate("() => JSON.parse(localStorage.getItem('tokenrelay.v1.inflight'))")
    (record,) = saved.values()
    assert record["streamId"] and record["resumeToken"] and record["lastSeq"] > 0
    page.reload()
    page.wait_for_selector(ASSISTANT)
    assert wait_finished(page) == "done"
    assert last_answer_raw(page) == expected
    assert page.evaluate("() => window.tokenrelay.client.stats.resumes") >= 1
    assert page.evaluate("() => localStorage.getItem('tokenrelay.v1.inflight')") == "{}"
    assert desktop.console_errors() == []


# --- stop -----------------------------------------------------------------------------------


def test_stop_cancels_and_the_server_reports_it(desktop: PageHandle, server: Server) -> None:
    page = open_chat(desktop, server, f"?temperature=0&max_tokens={STOP_MAX}")
    ask(page, LONG_Q)
    wait_streaming_text(page, 10)
    active = page.evaluate(
        "() => { const a = window.tokenrelay.active;"
        " return {streamId: a.streamId, resumeToken: a.resumeToken}; }"
    )
    page.click("[data-testid=stop]")
    assert wait_finished(page, timeout=20_000) == "cancelled"
    assert page.locator("[data-testid=send]").is_visible()
    assert page.locator("[data-testid=stop]").is_hidden()
    partial = last_answer_raw(page)
    assert len(partial) > 0
    # ask the server on a separate socket: the stream ended as cancelled
    frames = server.run(
        [
            {
                "type": "resume",
                "stream_id": active["streamId"],
                "resume_token": active["resumeToken"],
                "after": 0,
            }
        ]
    )
    done = frames[-1]
    assert done["type"] == "done"
    assert done["finish_reason"] == "cancelled"
    assert done["usage"]["completion_tokens"] < STOP_MAX
    replayed = "".join(f["text"] for f in frames if f["type"] == "token")
    assert replayed.startswith(partial)
    assert desktop.console_errors() == []


def test_escape_stops_the_answer(desktop: PageHandle, server: Server) -> None:
    page = open_chat(desktop, server, f"?temperature=0&max_tokens={STOP_MAX}")
    ask(page, LONG_Q)
    wait_streaming_text(page, 5)
    page.keyboard.press("Escape")
    assert wait_finished(page, timeout=20_000) == "cancelled"
    page.wait_for_function(
        "() => document.getElementById('announcer').textContent.startsWith('Answer stopped')"
    )
    # regenerate starts a fresh answer in place of the stopped one
    page.locator(ASSISTANT).last.locator("[data-testid=regenerate]").click()
    page.wait_for_function(f"() => {LAST_ASSISTANT_JS}.dataset.state === 'streaming'")
    page.click("[data-testid=stop]")
    assert wait_finished(page, timeout=20_000) == "cancelled"
    assert page.locator(ASSISTANT).count() == 1
    assert desktop.console_errors() == []


# --- safety ---------------------------------------------------------------------------------

XSS = [
    '<img src=x onerror="window.__xss = 1">',
    "<script>window.__xss = 2</script>",
    '<svg onload="window.__xss = 3"></svg>',
    '[click](javascript:window.__xss=4) <a href="javascript:window.__xss=5">a</a>',
    '<iframe srcdoc="<script>parent.__xss=6</script>"></iframe>',
]


def test_user_input_is_never_html(desktop: PageHandle, server: Server) -> None:
    page = open_chat(desktop, server, "?temperature=0&max_tokens=2")
    for payload in XSS[:2]:
        ask(page, payload)
        wait_finished(page)
    assert user_message_texts(page) == XSS[:2]
    messages = page.locator("#messages")
    assert messages.locator("img, script, svg, iframe").count() == 0
    assert page.evaluate("() => window.__xss") is None
    assert desktop.console_errors() == []


def test_model_output_is_never_html(desktop: PageHandle, server: Server) -> None:
    """Assistant text goes through the same renderer live and from storage: seed storage with
    hostile 'answers', load the page, and check they show as text and nothing runs."""
    page = desktop.page
    open_chat(desktop, server)  # an empty chat, to write its localStorage
    conv = {
        "id": "cxss",
        "title": '<img src=x onerror="window.__xss=7">',
        "createdAt": 1,
        "updatedAt": 1,
        "messages": [
            {"id": f"m{i}", "role": "assistant", "content": p, "state": "done", "createdAt": 1}
            for i, p in enumerate([*XSS, "```html\n<script>window.__xss=8</script>\n```"])
        ],
    }
    page.evaluate(
        "c => { localStorage.setItem('tokenrelay.v1.conversations',"
        " JSON.stringify({order: [c.id], items: {[c.id]: c}}));"
        " localStorage.setItem('tokenrelay.v1.current', JSON.stringify(c.id)); }",
        conv,
    )
    page.reload()
    page.wait_for_selector(ASSISTANT)
    answers = page.locator(ASSISTANT + " [data-testid=message-content]")
    assert answers.count() == len(XSS) + 1
    texts = answers.all_inner_texts()
    assert "<img src=x onerror=" in texts[0]
    assert "<script>window.__xss = 2</script>" in texts[1]
    assert "<script>window.__xss=8</script>" in texts[-1]
    assert page.locator("#messages").locator("img, script, svg, iframe").count() == 0
    hrefs = page.eval_on_selector_all("#messages a", "els => els.map(a => a.getAttribute('href'))")
    assert not any(h and h.lower().startswith("javascript:") for h in hrefs)
    assert page.locator("[data-testid=conversation]").inner_text().startswith("<img")
    page.wait_for_timeout(300)
    assert page.evaluate("() => window.__xss") is None
    assert desktop.console_errors() == []


# --- presets, QA hooks, layout ------------------------------------------------------------


def test_url_presets_fill_the_settings(desktop: PageHandle, server: Server) -> None:
    page = open_chat(
        desktop, server, "?temperature=0&max_tokens=64&seed=7&system=Be%20terse.&top_p=bad"
    )
    page.click("[data-testid=settings-toggle]")
    assert page.input_value("[data-testid=setting-temperature]") == "0.0"
    assert page.input_value("[data-testid=setting-max_tokens]") == "64"
    assert page.input_value("[data-testid=setting-seed]") == "7"
    assert page.input_value("[data-testid=setting-system]") == "Be terse."
    assert "top_p" in page.locator("[data-testid=ignored-presets]").inner_text()
    settings = page.evaluate("() => window.tokenrelay.settings()")
    assert settings["params"]["temperature"] == 0
    assert settings["params"]["max_tokens"] == 64
    assert settings["params"]["seed"] == 7
    assert settings["system"] == "Be terse."
    assert page.evaluate("() => typeof window.tokenrelay.client.dropConnection") == "function"
    assert desktop.console_errors() == []


def test_phone_layout_is_usable(phone: PageHandle, server: Server) -> None:
    page = open_chat(phone, server, f"?temperature=0&max_tokens={SHORT_MAX}")
    for sel in ("[data-testid=composer]", "[data-testid=send]", "[data-testid=connection]"):
        box = page.locator(sel).bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390, sel
        assert box["y"] + box["height"] <= 844, sel
    ask(page, SHORT_Q)
    assert wait_finished(page) == "done"
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 390
    # the conversation list opens from the menu button and closes again
    page.click("#toggle-sidebar")
    page.wait_for_selector("#sidebar[data-open=true]")
    page.keyboard.press("Escape")
    page.wait_for_selector("#sidebar[data-open=false]")
    assert phone.console_errors() == []
