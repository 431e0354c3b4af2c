"""The widget's ``model`` attribute and its translatable texts, on ``/embed-demo``.

``model`` goes out with every ``generate`` (the frames on the socket, through Playwright), a
model the gateway does not serve comes back as its ``not_found``, and without the attribute
the frame has none. Every text comes from the widget's one table: the ``strings`` attribute
(JSON) translates them all at once, the messages and a stopped answer's note included; the
``strings`` property lays its texts over the attribute's; unknown keys, non-texts and an
attribute that is not JSON change nothing.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from tests.web.conftest import PageHandle, Server
from tests.web.test_widget import open_widget

pytestmark = pytest.mark.browser

CHAT = "document.querySelector('tokenrelay-chat')"
MESSAGES = "tokenrelay-chat [data-testid=message]"
ERRORS_INIT = (
    "window.__errors = [];"
    "document.addEventListener('tokenrelay:error', (e) => window.__errors.push(e.detail));"
)


def send(h: PageHandle, text: str) -> None:
    box = h.page.locator("tokenrelay-chat [data-testid=composer]")
    box.fill(text)
    box.press("Enter")


def test_the_model_attribute_reaches_the_gateway(desktop: PageHandle, server: Server) -> None:
    with urllib.request.urlopen(server.base + "/v1/models", timeout=10) as r:
        model = json.load(r)["data"][0]["id"]
    p = desktop.page
    p.add_init_script(ERRORS_INIT)
    sent: list[dict[str, Any]] = []
    p.on("websocket", lambda ws: ws.on("framesent", lambda data: sent.append(json.loads(data))))
    open_widget(desktop, server)
    chat = p.locator("tokenrelay-chat")
    chat.evaluate(
        f"el => {{ el.setAttribute('model', {json.dumps(model)});"
        " el.setAttribute('max-tokens', '4'); el.setAttribute('temperature', '0'); }"
    )
    send(desktop, "Hi")
    p.wait_for_selector(MESSAGES + "[data-role=assistant][data-state=done]", timeout=120_000)
    generates = [f for f in sent if f.get("type") == "generate"]
    assert [f["model"] for f in generates] == [model]

    # a model no worker serves: the gateway's not_found, on the answer and as one event
    chat.evaluate("el => el.setAttribute('model', 'no-such-model')")
    send(desktop, "Hi again")
    p.wait_for_selector(MESSAGES + "[data-role=assistant][data-state=error]")
    assert [f["model"] for f in sent if f.get("type") == "generate"] == [model, "no-such-model"]
    errors = p.evaluate("() => window.__errors")
    assert [(e["code"], e["source"]) for e in errors] == [("not_found", "stream")], errors
    note = p.locator(MESSAGES + "[data-role=assistant] .note").last.inner_text()
    assert note.endswith("(not_found)"), note

    # removed: no model field, the gateway's default model answers
    chat.evaluate("el => el.removeAttribute('model')")
    send(desktop, "Hi once more")
    p.wait_for_function(
        f"() => {CHAT}.shadowRoot.querySelectorAll('[data-role=assistant][data-state=done]')"
        ".length === 2",
        timeout=120_000,
    )
    assert "model" not in [f for f in sent if f.get("type") == "generate"][-1]


FRENCH = {
    "openChat": "Ouvrir la discussion : {title}",
    "closeChat": "Fermer",
    "messages": "Messages échangés",
    "messageLabel": "Votre message",
    "placeholder": "Écrivez ici...",
    "send": "Envoyer",
    "stop": "Arrêter",
    "poweredBy": "Propulsé par tokenrelay",
    "youSaid": "Vous avez dit :",
    "answer": "Réponse :",
    "stopped": "Arrêté",
    "stateOpen": "En ligne",
}
TEXTS = """() => {
  const r = document.querySelector('tokenrelay-chat').shadowRoot;
  const q = (s) => r.querySelector(s);
  return {
    launcher: q('.launcher').getAttribute('aria-label'),
    close: q('.close').getAttribute('aria-label'),
    list: q('.messages').getAttribute('aria-label'),
    label: q('label').textContent,
    placeholder: q('textarea').placeholder,
    send: q('[data-testid=send]').textContent,
    stop: q('[data-testid=stop]').textContent,
    foot: q('.foot').textContent,
    conn: q('[data-testid=connection] .label').textContent,
    said: [...r.querySelectorAll('[data-role=user] .vh')].map((n) => n.textContent),
    answer: [...r.querySelectorAll('[data-role=assistant] .vh')].map((n) => n.textContent),
    notes: [...r.querySelectorAll('.note')].map((n) => n.textContent),
  };
}"""


def test_the_widget_speaks_the_language_it_is_given(desktop: PageHandle, server: Server) -> None:
    p = desktop.page
    open_widget(desktop, server)
    chat = p.locator("tokenrelay-chat")
    english = p.evaluate(TEXTS)
    assert english["send"] == "Send" and english["conn"] == "Online"
    assert english["launcher"] == "Open chat: Trail assistant"  # /embed-demo's data-title

    # the attribute (JSON) translates every text at once; chat-title still names the chat
    chat.evaluate(f"el => el.setAttribute('strings', {json.dumps(json.dumps(FRENCH))})")
    assert p.evaluate(TEXTS) == {
        "launcher": "Ouvrir la discussion : Trail assistant",
        "close": "Fermer",
        "list": "Messages échangés",
        "label": "Votre message",
        "placeholder": "Écrivez ici...",
        "send": "Envoyer",
        "stop": "Arrêter",
        "foot": "Propulsé par tokenrelay",
        "conn": "En ligne",
        "said": [],
        "answer": [],
        "notes": [],
    }
    # the messages too, a stopped answer's note included
    chat.evaluate("el => el.setAttribute('max-tokens', '200')")
    send(desktop, "Write a long story about a lighthouse keeper.")
    p.wait_for_selector(MESSAGES + "[data-role=assistant][data-state=streaming]")
    p.click("tokenrelay-chat [data-testid=stop]")
    p.wait_for_selector(MESSAGES + "[data-role=assistant][data-state=cancelled]", timeout=30_000)
    texts = p.evaluate(TEXTS)
    assert (texts["said"], texts["answer"], texts["notes"]) == (
        ["Vous avez dit :"],
        ["Réponse :"],
        ["Arrêté"],
    )

    # the property lays its texts over the attribute's; the whole table reads back
    chat.evaluate("el => { el.strings = { send: 'Go', stopped: 'Halted' }; }")
    texts = p.evaluate(TEXTS)
    assert (texts["send"], texts["stop"], texts["notes"]) == ("Go", "Arrêter", ["Halted"])
    table = chat.evaluate("el => el.strings")
    assert table["send"] == "Go" and table["closeChat"] == "Fermer"
    assert table["unfinished"] == "The answer did not finish."  # English where not given
    # unknown keys and non-texts are ignored; an attribute that is not JSON: English again
    chat.evaluate("el => { el.strings = { sned: 'x', stop: 42 }; }")
    assert p.evaluate(TEXTS)["stop"] == "Arrêter"
    chat.evaluate("el => el.setAttribute('strings', '{not json')")
    assert p.evaluate(TEXTS)["send"] == "Send"
    assert desktop.console_errors() == []
