"""A chat rendered by the model's chat template, tools and tool turns included.

A template that takes ``tools`` (Qwen2.5's and most recent ones mention them) gets
the messages as transformers expects them: an assistant turn's ``tool_calls`` with
their arguments as objects, ``tool`` turns as they are, and the offered tools. A
template that does not (SmolLM2's) gets a plain chat instead, in the Hermes format
the parser of core/wire/tools.py reads back:

* the tools are described in the system message (:func:`core.wire.tools.system_prompt`,
  after the client's own system text, or as the first message);
* an assistant turn's calls are appended to its content as ``<tool_call>`` blocks;
* a run of ``tool`` turns becomes one user turn of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tokenrelay.core.wire.content import TEXT_ONLY, has_images
from tokenrelay.core.wire.tool_formats import SYNTAX, ToolFormat
from tokenrelay.core.wire.tools import Tool, render_call, system_prompt

CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: Any) -> None:
    """``ValueError`` naming the field unless ``messages`` is a list of chat turns."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be an object with role and content")
        if msg.get("role") not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}")
        if has_images(msg.get("content")):
            raise ValueError(f"messages[{i}].content: {TEXT_ONLY}")
        if not isinstance(msg.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
        calls = msg.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise ValueError(f"messages[{i}].tool_calls must be a list")


def takes_tools(template: str) -> bool:
    """Whether a chat template renders a ``tools`` list (a look at its source)."""
    return "tools" in template


def _arguments(call: dict[str, Any]) -> Any:
    fn = call.get("function") or {}
    args = fn.get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


def native_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers' templates take tool calls (arguments as objects)."""
    out = []
    for msg in messages:
        m = dict(msg)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": _arguments(c)}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def plain_messages(messages: list[dict[str, Any]], tools: Sequence[Tool]) -> list[dict[str, str]]:
    """The messages as ``{"role", "content"}`` turns of user/assistant/system only."""
    out: list[dict[str, str]] = []
    for msg in messages:
        role, content = msg["role"], msg["content"]
        if role == "assistant" and msg.get("tool_calls"):
            calls = [render_call(c["function"]["name"], _arguments(c)) for c in msg["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool"):
                out[-1]["content"] += "\n" + block
                continue
            out.append({"role": "user", "content": block, "tool": "1"})
            continue
        out.append({"role": role, "content": content})
    for m in out:
        m.pop("tool", None)
    if tools:
        described = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: Sequence[Tool] = ()) -> str:
    """The prompt text of ``messages`` (checked) ending with the assistant's turn."""
    check_messages(messages)
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("messages: this model has no chat template; send a prompt instead")
    if takes_tools(str(template)):
        offered = [t.to_dict() for t in tools] or None
        text = tokenizer.apply_chat_template(
            native_messages(messages), tools=offered, add_generation_prompt=True, tokenize=False
        )
    else:
        text = tokenizer.apply_chat_template(
            plain_messages(messages, tools), add_generation_prompt=True, tokenize=False
        )
    return str(text)


def marker_tokens(tokenizer: Any, fmt: ToolFormat) -> dict[int, str]:
    """The special tokens among ``fmt``'s markers (``<|python_tag|>``, ``[TOOL_CALLS]``,
    ``<|tool_call|>`` in their families' vocabularies), by id: a detokenizer that skips
    special tokens keeps these, so the call parser sees them."""
    syntax = SYNTAX[fmt]
    markers = [*syntax.openers, syntax.closer, syntax.named_args]
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special |= {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return {vocab[m]: m for m in markers if m and vocab.get(m) in special}
