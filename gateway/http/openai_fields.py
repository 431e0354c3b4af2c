"""Every request field of the OpenAI chat and completions APIs, and what this server does with it.

No field is silently ignored (docs/api.md, "Request fields", is the table for
people). Each name of a request body is one of:

- *supported*: parsed and honoured (gateway/http/openai_request.py);
- *accepted*: a hint that changes nothing about the answer this server can
  give (``user``, ``store``, ``metadata``...), checked for its type and
  otherwise ignored, as documented;
- *refused*: a feature this server does not have; a 400
  ``invalid_request_error`` naming the field unless its value asks for nothing
  (null, ``false``, ``modalities: ["text"]``, ``function_call: "none"``...);
- anything else: a 400 ``Unrecognized request argument supplied``, as OpenAI
  answers it.

Sans I/O: :func:`check_fields` raises :class:`ApiError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "ACCEPTED",
    "CHAT_SUPPORTED",
    "COMPLETION_SUPPORTED",
    "REFUSED",
    "TOOL_FIELDS",
    "check_fields",
]

# vLLM's sampling extensions this server honours on both endpoints
EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids")
# tokenrelay's own, both endpoints: seconds the stream keeps generating with no client attached
DETACH_FIELDS = ("detach_timeout",)
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # chat only (core/wire/tools.py)
COMMON = (
    *("model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n"),
    *("stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs"),
    "response_format",  # structured outputs (vLLM takes it on completions too)
    *EXTENSIONS,
    *DETACH_FIELDS,
)
CHAT_SUPPORTED = frozenset(
    (*COMMON, "messages", "max_completion_tokens", "top_logprobs", *TOOL_FIELDS)
)
COMPLETION_SUPPORTED = frozenset((*COMMON, "prompt", "best_of", "echo", "suffix"))


def _is(*types: type) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        return isinstance(value, types) and (bool in types or not isinstance(value, bool))

    return check


def _metadata(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and len(value) <= 16
        and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    )


# accepted and ignored (both endpoints take user), with the shape OpenAI gives them
ACCEPTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "user": (_is(str), "a string"),
    "store": (_is(bool), "a boolean"),
    "metadata": (_metadata, "an object of at most 16 string values"),
    "safety_identifier": (_is(str), "a string"),
    "prompt_cache_key": (_is(str), "a string"),
    "prompt_cache_retention": (_is(str), "a string"),
    "service_tier": (lambda v: v in ("auto", "default"), "'auto' or 'default' here"),
}
COMPLETION_ACCEPTED = frozenset(("user",))


def _nothing(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


# refused unless the value asks for nothing: name -> (asks for nothing?, what is missing)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "audio": (_nothing(None), "audio output is not supported by this server"),
    "modalities": (_nothing(None, ["text"]), "only the 'text' modality is supported"),
    "prediction": (_nothing(None), "predicted outputs are not supported by this server"),
    "web_search_options": (_nothing(None), "web search is not supported by this server"),
    "reasoning_effort": (_nothing(None), "this model does not reason: no 'reasoning_effort'"),
    "verbosity": (_nothing(None), "'verbosity' is not supported with this model"),
    "moderation": (_nothing(None), "moderation is not supported by this server"),
    "prompt_cache_options": (_nothing(None), "'prompt_cache_options' is not supported"),
    "functions": (_nothing(None), "function calls are not supported by this server"),
    "function_call": (_nothing(None, "none"), "function calls are not supported by this server"),
}
STREAM_OPTIONS = frozenset(("include_usage", "include_obfuscation"))


def check_fields(obj: dict[str, Any], kind: str, bad: Callable[[str, str], Exception]) -> None:
    """Refuse what ``obj`` (a ``chat`` or ``completion`` body) asks that this server cannot do.

    ``bad(message, param)`` builds the 400 raised. Supported fields are left to
    their parser; this checks the names, the accepted hints and the refused features.
    """
    supported = CHAT_SUPPORTED if kind == "chat" else COMPLETION_SUPPORTED
    for name, value in obj.items():
        if name in supported:
            continue
        hint = ACCEPTED.get(name)
        if hint is not None and (kind == "chat" or name in COMPLETION_ACCEPTED):
            if value is not None and not hint[0](value):
                raise bad(f"'{name}' must be {hint[1]}", name)
            continue
        refused = REFUSED.get(name) if kind == "chat" else None
        if refused is not None:
            if not refused[0](value):
                raise bad(f"'{name}' is not supported: {refused[1]}.", name)
            continue
        raise bad(f"Unrecognized request argument supplied: {name}", name)
    options = obj.get("stream_options")
    if isinstance(options, dict):
        for key, value in options.items():
            if key not in STREAM_OPTIONS:
                raise bad(f"Unrecognized stream option: {key}", "stream_options")
            if value is not None and not isinstance(value, bool):
                raise bad(f"'stream_options.{key}' must be a boolean", "stream_options")
