"""OpenAI-compatible request validation and error bodies, sans I/O.

:func:`parse_chat` and :func:`parse_completion` turn a request body into an
:class:`ApiRequest` (the engine worker's request body plus the streaming
options), or raise :class:`ApiError`: the HTTP status and the OpenAI-style
error body ``{"error": {"message", "type", "param", "code"}}`` the client
gets. No field is silently ignored (gateway/http/openai_fields.py: unknown
fields and features this server does not have are 400s naming the field);
known fields of the wrong type, or values this server cannot honour (``best_of``
> 1, ``echo``...), are 400s too. Sampling fields and messages go through the
validator every transport shares (:mod:`tokenrelay.core.wire.requests`), so they are
refused as on the WebSocket. docs/api.md ("Request fields") lists the fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from tokenrelay.core.wire.errors import RequestError, lookup
from tokenrelay.core.wire.params import MAX_CHOICES, MAX_TOP_LOGPROBS
from tokenrelay.core.wire.requests import (
    Limits,
    check_input_size,
    check_output_budget,
    validate_detach_timeout,
    validate_messages,
    validate_params,
    validate_request_id,
)
from tokenrelay.core.wire.vocabulary import ErrorCode
from tokenrelay.gateway.http.openai_fields import EXTENSIONS, TOOL_FIELDS, check_fields

__all__ = [
    "ApiError",
    "ApiRequest",
    "error_body",
    "error_for_code",
    "parse_chat",
    "parse_completion",
    "parse_json",
    "request_id_header",
]

CHAT_ROLES = {"developer": "system", **{r: r for r in ("system", "user", "assistant", "tool")}}
# the OpenAI fields that are SamplingParams fields of the same name (and vLLM's extensions)
SAMPLING_FIELDS = (
    *("max_tokens", "temperature", "top_p", "seed", "stop"),
    *("presence_penalty", "frequency_penalty", "logit_bias", "response_format", *EXTENSIONS),
    *TOOL_FIELDS,  # only chat takes them (openai_fields.check_fields)
)
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs: 0 to 5 alternatives (OpenAI's range)


class ApiError(Exception):
    """A client-visible HTTP error with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        """``{"error": {...}}`` as OpenAI sends it."""
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        """``Retry-After`` for 429/503 (whole seconds, at least 1)."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_for_code(
    code: ErrorCode, message: str, *, param: str | None = None, retry_after: float | None = None
) -> ApiError:
    """An :class:`ApiError` for a protocol error code (``bad_request``, ``overloaded``...).

    Status, OpenAI error type and default ``Retry-After`` come from
    :data:`core.wire.errors.ERRORS`; an unknown code is ``internal``.
    """
    kind = lookup(code)
    if retry_after is None:
        retry_after = kind.retry_after
    return ApiError(
        kind.status, message, type=kind.type, param=param, code=kind.code, retry_after=retry_after
    )


def request_error(exc: RequestError) -> ApiError:
    """The :class:`ApiError` for a refusal of the shared request validator."""
    return error_for_code(exc.code, exc.message, param=exc.field)


def request_id_header(value: str | None, limits: Limits) -> str | None:
    """The client's ``X-Request-Id`` (None when absent or empty), or a 400 naming it.

    The same shape as a WebSocket ``request_id`` (:func:`validate_request_id`):
    the id is echoed in response headers and logs as it is.
    """
    if not value:
        return None
    try:
        return validate_request_id(value, limits, "X-Request-Id")
    except RequestError as exc:
        raise request_error(exc) from None


def _bad(message: str, param: str | None = None) -> ApiError:
    return error_for_code(ErrorCode.BAD_REQUEST, message, param=param)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        msg = "We could not parse the JSON body of your request: it is not valid JSON."
        raise _bad(msg) from None
    if not isinstance(obj, dict):
        raise _bad("The request body must be a JSON object.")
    if _SURROGATE_ESCAPE.search(raw):  # "\\ud800" alone parses, but is no UTF-8 text
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _bad("The request body holds an unpaired UTF-16 surrogate.") from None
    return obj


@dataclass(frozen=True)
class ApiRequest:
    """A validated completion request."""

    kind: str  # "chat" or "completion"
    model: str
    body: dict[str, Any]  # what the engine worker gets (messages or prompt, params)
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    logprobs: bool = False  # the answer carries logprobs
    tools: bool = False  # tools were offered: calls are parsed from the text
    n: int = 1  # choices (gateway/http/openai_choices.py)
    detach_timeout: float | None = None  # None: the gateway's --detach-timeout


# --- field checks ---------------------------------------------------------------


def _opt(obj: dict[str, Any], name: str, types: tuple[type, ...], what: str) -> Any:
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in types:
        raise _bad(f"'{name}' must be {what}, got a boolean", name)
    if not isinstance(value, types):
        raise _bad(f"'{name}' must be {what}, got {type(value).__name__}", name)
    return value


def _model(obj: dict[str, Any], served: str) -> str:
    model = _opt(obj, "model", (str,), "a string")
    if model is None:
        return served
    if model != served:
        shown = model if len(model) <= 80 else model[:80] + "..."
        raise ApiError(
            404,
            f"The model `{shown}` does not exist. This server serves `{served}`.",
            param="model",
            code="model_not_found",
        )
    return served


def _logprobs(obj: dict[str, Any], kind: str) -> tuple[int | None, str]:
    """The SamplingParams ``logprobs`` (alternatives per token, None: off) and its field.

    Chat: ``logprobs: true`` with ``top_logprobs`` 0-20 alternatives (which needs
    ``logprobs``); completions: ``logprobs`` 0-5.
    """
    if kind == "completion":
        value = _opt(obj, "logprobs", (int,), "an integer")
        if value is not None and not 0 <= value <= MAX_COMPLETION_LOGPROBS:
            message = f"'logprobs' must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {value}"
            raise _bad(message, "logprobs")
        return value, "logprobs"
    on = bool(_opt(obj, "logprobs", (bool,), "a boolean"))
    top = _opt(obj, "top_logprobs", (int,), "an integer")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        message = f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {top}"
        raise _bad(message, "top_logprobs")
    if top and not on:
        raise _bad("'top_logprobs' needs 'logprobs' set to true.", "top_logprobs")
    return (top or 0) if on else None, "top_logprobs"


def _choices(obj: dict[str, Any]) -> int:
    """``n``: 1 to :data:`MAX_CHOICES` choices (each its own stream)."""
    n = _opt(obj, "n", (int,), "an integer")
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise _bad(f"'n' must be between 1 and {MAX_CHOICES}, got {n}", "n")
    return n or 1


def _budget(params: dict[str, Any], n: int, limits: Limits) -> int:
    """``n``, once the answer's size (``n`` x max_tokens x (1 + top_logprobs)) fits."""
    try:
        check_output_budget(params["max_tokens"], params["logprobs"], n, limits)
    except RequestError as exc:
        raise request_error(exc) from None
    return n


def _params(obj: dict[str, Any], limits: Limits, kind: str = "chat") -> dict[str, Any]:
    """Sampling fields -> SamplingParams (validated) as a dict for the worker."""
    best_of = _opt(obj, "best_of", (int,), "an integer")
    if best_of is not None and best_of != 1:
        raise _bad("Only best_of = 1 is supported.", "best_of")
    # OpenAI names and shapes -> SamplingParams fields (null means "not given")
    raw = {k: obj[k] for k in SAMPLING_FIELDS if obj.get(k) is not None}
    names: dict[str, str] = {}
    logprobs, names["logprobs"] = _logprobs(obj, kind)
    if logprobs is not None:
        raw["logprobs"] = logprobs
    if obj.get("max_completion_tokens") is not None:  # wins over max_tokens
        _opt(obj, "max_tokens", (int,), "an integer")
        raw["max_tokens"] = obj["max_completion_tokens"]
        names["max_tokens"] = "max_completion_tokens"
    raw.setdefault("max_tokens", limits.max_tokens)  # default: as long as allowed
    top_p = raw.get("top_p")
    greedy = top_p == 0 and isinstance(top_p, int | float) and not isinstance(top_p, bool)
    if greedy:  # the limit of nucleus sampling as p -> 0 is greedy
        del raw["top_p"]
    try:
        params = validate_params(raw, limits, names=names)
    except RequestError as exc:
        raise request_error(exc) from None
    if greedy:
        params = dataclasses.replace(params, temperature=0.0)
    return dataclasses.asdict(params)


def _detach_timeout(obj: dict[str, Any], limits: Limits) -> float | None:
    """tokenrelay's ``detach_timeout`` (seconds; None: not given), checked as on the WebSocket."""
    try:
        return validate_detach_timeout(obj.get("detach_timeout"), limits)
    except RequestError as exc:
        raise request_error(exc) from None


def _stream_options(obj: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(_opt(obj, "stream", (bool,), "a boolean"))
    opts = _opt(obj, "stream_options", (dict,), "an object")
    include_usage = False
    if opts is not None:
        value = opts.get("include_usage")
        if value is not None and not isinstance(value, bool):
            raise _bad("'stream_options.include_usage' must be a boolean", "stream_options")
        include_usage = bool(value)
    return stream, include_usage


def _common(obj: dict[str, Any]) -> tuple[bool, bool, str | None]:
    stream, include_usage = _stream_options(obj)
    user = _opt(obj, "user", (str,), "a string")
    return stream, include_usage, user


# --- requests -------------------------------------------------------------------


def parse_chat(obj: dict[str, Any], *, served_model: str, limits: Limits) -> ApiRequest:
    """Validate a ``/v1/chat/completions`` body."""
    model = _model(obj, served_model)
    check_fields(obj, "chat", _bad)
    messages = obj.get("messages")
    if messages is None:
        raise _bad("Missing required parameter: 'messages'.", "messages")
    try:
        parsed = validate_messages(messages, limits, roles=CHAT_ROLES)
    except RequestError as exc:
        raise request_error(exc) from None
    params = _params(obj, limits, "chat")
    stream, include_usage, user = _common(obj)
    out = [m.body() for m in parsed]
    body = {"params": params, "messages": out}
    logprobs = params["logprobs"] is not None
    tools = bool(params["tools"]) and params["tool_choice"] != "none"
    return ApiRequest("chat", model, body, stream, include_usage, user, logprobs=logprobs,
                      tools=tools, n=_budget(params, _choices(obj), limits),
                      detach_timeout=_detach_timeout(obj, limits))  # fmt: skip


def _prompt(raw: Any) -> str | list[int]:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]  # a batch of one prompt
    if isinstance(raw, str):
        if not raw:
            raise _bad("'prompt' must not be empty", "prompt")
        return raw
    if isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
        if any(isinstance(t, bool) or t < 0 for t in raw):
            raise _bad("'prompt' token ids must be non-negative integers", "prompt")
        return list(raw)
    if isinstance(raw, list) and len(raw) > 1 and all(isinstance(t, str | list) for t in raw):
        raise _bad("Only one prompt per request is supported.", "prompt")
    raise _bad("'prompt' must be a string or a list of token ids", "prompt")


def parse_completion(obj: dict[str, Any], *, served_model: str, limits: Limits) -> ApiRequest:
    """Validate a ``/v1/completions`` body."""
    model = _model(obj, served_model)
    check_fields(obj, "completion", _bad)
    if obj.get("prompt") is None:
        raise _bad("Missing required parameter: 'prompt'.", "prompt")
    prompt = _prompt(obj["prompt"])
    try:
        check_input_size(len(prompt), limits)
    except RequestError as exc:
        raise request_error(exc) from None
    if obj.get("echo") not in (None, False):
        raise _bad("'echo' is not supported by this server.", "echo")
    if obj.get("suffix") not in (None, ""):
        raise _bad("'suffix' is not supported by this server.", "suffix")
    params = _params(obj, limits, "completion")
    stream, include_usage, user = _common(obj)
    body = {"params": params, "prompt": prompt}
    logprobs = params["logprobs"] is not None
    return ApiRequest("completion", model, body, stream, include_usage, user, logprobs=logprobs,
                      n=_budget(params, _choices(obj), limits),
                      detach_timeout=_detach_timeout(obj, limits))  # fmt: skip
