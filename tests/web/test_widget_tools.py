"""The widget's tool calls, on ``/embed-demo`` against the real server: the ``params``
property offers ``tools`` (a named ``tool_choice`` makes the default model call), the answer
shows the call while the model writes it ("Calling get_weather..." and the arguments so
far), then the call whole ("Called get_weather"), in the texts of the ``strings`` table, and
``tokenrelay:done`` carries the gateway's calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.web.conftest import PageHandle, Server
from tests.web.test_widget import open_widget
from tests.web.test_widget_model_and_texts import send

pytestmark = pytest.mark.browser

QUESTION = "What is the weather in Paris?"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}
PARAMS: dict[str, Any] = {
    "tools": [WEATHER],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
}
# what the answer's call lines read at every frame, and the done events' details
WATCH = """
window.__lines = []; window.__done = [];
document.addEventListener('tokenrelay:done', (e) => window.__done.push(e.detail));
const look = () => {
  const root = document.querySelector('tokenrelay-chat')?.shadowRoot;
  const line = root && [...root.querySelectorAll('[data-testid=tool-call]')].pop();
  if (line) {
    const seen = [line.querySelector('span').textContent, line.querySelector('code').textContent];
    const last = window.__lines.at(-1);
    if (!last || last[0] !== seen[0] || last[1] !== seen[1]) window.__lines.push(seen);
  }
  requestAnimationFrame(look);
};
requestAnimationFrame(look);
"""


def test_the_widget_shows_a_call_while_it_is_written(desktop: PageHandle, server: Server) -> None:
    params = {**PARAMS, "max_tokens": 120, "temperature": 0}
    frames = server.run(
        [
            {
                "type": "generate",
                "request_id": "widget-call",
                "messages": [{"role": "user", "content": QUESTION}],
                "params": params,
            }
        ]
    )
    assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "tool_calls"
    expected = frames[-1]["tool_calls"][0]["function"]["arguments"]

    p = desktop.page
    p.add_init_script(WATCH)
    open_widget(desktop, server)
    chat = p.locator("tokenrelay-chat")
    strings = {"callingTool": "Appel de {name}...", "calledTool": "Appel fait : {name}"}
    chat.evaluate(
        f"el => {{ el.params = {json.dumps(PARAMS)}; el.strings = {json.dumps(strings)};"
        " el.setAttribute('max-tokens', '120'); el.setAttribute('temperature', '0'); }"
    )
    send(desktop, QUESTION)
    p.wait_for_function("() => window.__done.length === 1", timeout=120_000)

    lines = p.evaluate("() => window.__lines")
    streaming = [args for label, args in lines if label == "Appel de get_weather..."]
    assert streaming, lines
    assert all(expected.startswith(args) for args in streaming), lines
    assert any(args != expected for args in streaming), "a call shown before it was whole"
    assert lines[-1] == ["Appel fait : get_weather", expected], lines

    (done,) = p.evaluate("() => window.__done")
    assert done["state"] == "done" and done["text"] == ""
    ((call),) = done["toolCalls"]
    assert call["function"] == {"name": "get_weather", "arguments": expected}
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert desktop.console_errors() == []
