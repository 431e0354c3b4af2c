"""Validation of a generation request's sampling parameters and messages, sans I/O.

One validator for every transport (the WebSocket ``generate`` frame, the OpenAI-style
HTTP API, gRPC): each maps its own field names and shapes onto :func:`validate_params`
and :func:`validate_messages`, and turns the :class:`RequestError` they raise (an
``ErrorCode``, a message, the offending field) into its own error format. The limits
(:class:`Limits`) and the constants clients see in the docs are defined here once.

Ids a client chooses travel into HTTP headers, log lines and Redis:
:func:`validate_request_id` keeps them to one safe shape (:data:`REQUEST_ID_CHARS`), and
:func:`validate_resume_token` bounds resume tokens before they are hashed.

An input that cannot fit the model's context is refused before anyone tokenizes it
(:meth:`Limits.for_context`: :data:`CHARS_PER_TOKEN` per context token).

:func:`validate_detach_timeout` checks a request's ``detach_timeout``: how long its
stream keeps generating with no client attached (the gateway's ``--detach-timeout``
when none is given), at most ``--max-detach-timeout``. It travels beside the sampling
parameters but is none: the gateway writes it into the request record, not the body.

Long: the limits and every check of a request's fields, in the one place every transport
calls; split, each part would import the limits and the error helpers from the other.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tokenrelay.core.wire.content import MAX_IMAGES, TEXT_ONLY, Parts, parse_content, text_of
from tokenrelay.core.wire.errors import RequestError, ResponseFormatError
from tokenrelay.core.wire.params import (
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_TOP_LOGPROBS,
    SamplingParams,
)
from tokenrelay.core.wire.schema_budget import SchemaBudget
from tokenrelay.core.wire.structured import message_tool_fields, structured_params
from tokenrelay.core.wire.vocabulary import ErrorCode

# fmt: off
__all__ = [
    "CHARS_PER_TOKEN", "DEFAULT_MAX_DETACH_TIMEOUT", "DEFAULT_MAX_OUTPUT_ENTRIES",
    "DEFAULT_MAX_TOKENS_LIMIT", "MAX_RESUME_TOKEN", "MAX_SEED", "MAX_TEMPERATURE",
    "PARAM_NAMES", "REQUEST_ID_CHARS", "ROLES", "Limits", "Message", "RequestError",
    "check_input_size", "check_output_budget", "is_request_id", "validate_detach_timeout",
    "validate_messages", "validate_params", "validate_request_id", "validate_resume_token",
]
# fmt: on

DEFAULT_MAX_TOKENS_LIMIT = 8192  # --max-tokens-limit: the largest max_tokens accepted
# --max-output-entries: n x max_tokens x (1 + top_logprobs) at most; a non-streaming body
# holds them as its JSON text (gateway/http/openai_body.py), tens of bytes an entry
DEFAULT_MAX_OUTPUT_ENTRIES = 200_000
# --max-detach-timeout: the longest detach_timeout a request may ask for, in seconds
DEFAULT_MAX_DETACH_TIMEOUT = 600.0
# Characters per token above which an input is refused as too long for the context. Text
# averages 2.2-4.5 characters per token with the default model's tokenizer (English prose,
# code, markup); only long runs of one character (64 spaces are one token) go beyond 8.
CHARS_PER_TOKEN = 8
MAX_SEED = 2**63  # seeds are in [0, MAX_SEED)
MAX_TEMPERATURE = 2.0
MAX_REQUEST_ID = 128  # the longest request id, whatever Limits.max_request_id says
MAX_RESUME_TOKEN = 128  # ours are 43 characters (core/wire/ids.py)
REQUEST_ID_CHARS = "A-Z, a-z, 0-9, '.', '_', ':', '-'"  # as error messages spell it
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]+")
_RESUME_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]+")  # URL-safe base64, as new_resume_token makes
PARAM_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
ROLES: Mapping[str, str] = {r: r for r in ("system", "user", "assistant", "tool")}


@dataclass(frozen=True)
class Limits:
    """Size limits of one request (beyond the transport's own frame/body limit)."""

    max_request_id: int = MAX_REQUEST_ID
    max_messages: int = 256
    max_input_chars: int = 200_000  # prompt, or all message contents together
    max_stop: int = 16
    max_stop_chars: int = 200
    max_tokens: int = DEFAULT_MAX_TOKENS_LIMIT
    max_stop_token_ids: int = 64
    max_output_entries: int = DEFAULT_MAX_OUTPUT_ENTRIES
    max_detach_timeout: float = DEFAULT_MAX_DETACH_TIMEOUT
    schemas: SchemaBudget = dataclasses.field(default_factory=SchemaBudget)  # all schemas
    context_tokens: int | None = None  # the served model's context, when known
    vocab_size: int | None = None  # the served model's vocabulary, when known
    text_only: bool = False  # every serving worker runs our engine: no image parts

    def for_context(self, context_tokens: int | None) -> Limits:
        """These limits for a model of ``context_tokens`` (``None``: unknown, no bound).

        ``max_input_chars`` becomes at most :data:`CHARS_PER_TOKEN` per context token:
        a cheap check that needs no tokenizer, so a prompt far beyond the context costs
        the gateway a length comparison and the worker nothing. Call it on the
        configured limits, not on a result of it.
        """
        if context_tokens is None:
            return self
        bound = context_tokens * CHARS_PER_TOKEN
        return dataclasses.replace(
            self, max_input_chars=min(self.max_input_chars, bound), context_tokens=context_tokens
        )


@dataclass(frozen=True)
class Message:
    """One chat message, its role one of :data:`ROLES`; ``content`` is its text, ``parts``
    its content parts when an image is among them (core/wire/content.py)."""

    role: str
    content: str
    tools: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    parts: Parts = ()

    def body(self) -> dict[str, Any]:
        """The message as a worker's request body carries it."""
        content: str | list[dict[str, Any]] = list(self.parts) if self.parts else self.content
        return {"role": self.role, "content": content, **self.tools}


# --- sampling parameters --------------------------------------------------------


def _got(value: Any) -> str:
    names = {bool: "a boolean", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _bad(name: str, message: str) -> RequestError:
    return RequestError(ErrorCode.BAD_REQUEST, message, name)


def _too_large(name: str | None, message: str) -> RequestError:
    return RequestError(ErrorCode.TOO_LARGE, message, name)


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"{name} must be an integer, got {_got(value)}")
    return value


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, f"{name} must be a number, got {_got(value)}")
    return value


def _stop(value: Any, name: str, limits: Limits) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad(name, f"{name} must be a string or a list of strings")
    if len(stops) > limits.max_stop:
        raise _too_large(name, f"{name} may hold at most {limits.max_stop} strings")
    for s in stops:
        if not s:
            raise _bad(name, f"{name} strings must not be empty")
        if len(s) > limits.max_stop_chars:
            message = f"{name} strings are limited to {limits.max_stop_chars} characters"
            raise _too_large(name, message)
    return list(stops)


def validate_params(
    raw: Mapping[str, Any], limits: Limits, *, names: Mapping[str, str] | None = None
) -> SamplingParams:
    """``raw`` (SamplingParams field names -> values) as checked :class:`SamplingParams`.

    A field left out takes the SamplingParams default; ``None`` is a value (only
    ``seed`` and ``logprobs`` may be null). ``names`` renames fields in errors to
    the transport's own names (``{"max_tokens": "max_completion_tokens"}``).
    Raises :class:`RequestError`: ``bad_request`` for an unknown name, a wrong
    type or a value out of range (a token id outside ``limits.vocab_size`` when
    known), ``too_large`` for stop strings or stop token ids over ``limits`` (a
    single string counts as a list of one).
    """
    names = names or {}
    unknown = sorted(set(raw) - PARAM_NAMES)
    if unknown:
        raise _bad(unknown[0], f"unknown param {unknown[0]!r}")
    kw: dict[str, Any] = {}
    if "max_tokens" in raw:
        name = names.get("max_tokens", "max_tokens")
        value = _integer(raw["max_tokens"], name)
        if not 1 <= value <= limits.max_tokens:
            message = f"{name} must be between 1 and {limits.max_tokens}, got {value}"
            raise _bad(name, message)
        kw["max_tokens"] = value
    if "temperature" in raw:
        name = names.get("temperature", "temperature")
        number = _number(raw["temperature"], name)
        if not 0 <= number <= MAX_TEMPERATURE:
            message = f"{name} must be between 0 and {MAX_TEMPERATURE:g}, got {number}"
            raise _bad(name, message)
        kw["temperature"] = number
    if "top_p" in raw:
        name = names.get("top_p", "top_p")
        number = _number(raw["top_p"], name)
        if not 0 < number <= 1:
            raise _bad(name, f"{name} must be in (0, 1], got {number}")
        kw["top_p"] = number
    if "top_k" in raw:
        name = names.get("top_k", "top_k")
        value = _integer(raw["top_k"], name)
        if value < -1:
            raise _bad(name, f"{name} must be >= -1 (0 or -1 disables it), got {value}")
        kw["top_k"] = value
    if raw.get("seed") is not None:
        name = names.get("seed", "seed")
        value = _integer(raw["seed"], name)
        if not 0 <= value < MAX_SEED:
            raise _bad(name, f"{name} must be in [0, 2**63)")
        kw["seed"] = value
    if "stop" in raw:
        kw["stop"] = _stop(raw["stop"], names.get("stop", "stop"), limits)
    if "ignore_eos" in raw:
        name = names.get("ignore_eos", "ignore_eos")
        if not isinstance(raw["ignore_eos"], bool):
            raise _bad(name, f"{name} must be a boolean, got {_got(raw['ignore_eos'])}")
        kw["ignore_eos"] = raw["ignore_eos"]
    kw.update(_penalties(raw, limits, names))
    try:  # response_format, tools, tool_choice, parallel_tool_calls
        kw.update(structured_params(raw, names, bool(kw.get("ignore_eos")), limits.schemas))
    except ResponseFormatError as exc:
        raise RequestError(exc.code, str(exc), exc.field) from None
    check_output_budget(kw.get("max_tokens", SamplingParams.max_tokens), kw.get("logprobs"), 1,
                        limits, names)  # fmt: skip
    try:
        return SamplingParams(**kw)
    except ValueError as exc:  # defensive: everything was checked above
        raise RequestError(ErrorCode.BAD_REQUEST, str(exc)) from None


_RANGES: dict[str, tuple[float, float]] = {  # closed ranges of the number params
    "min_p": (0.0, 1.0),
    "presence_penalty": (-MAX_PENALTY, MAX_PENALTY),
    "frequency_penalty": (-MAX_PENALTY, MAX_PENALTY),
}


def _token(value: Any, name: str, limits: Limits) -> int:
    """A token id: an integer (or, as JSON object keys are, a decimal string) in the vocabulary."""
    if isinstance(value, str) and value.isascii() and value.isdecimal():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(name, f"{name}: token ids must be non-negative integers, got {value!r:.40}")
    if limits.vocab_size is not None and value >= limits.vocab_size:
        message = f"{name}: token id {value} is outside the vocabulary [0, {limits.vocab_size})"
        raise _bad(name, message)
    return value


def _penalties(raw: Mapping[str, Any], limits: Limits, names: Mapping[str, str]) -> dict[str, Any]:
    """The checked penalty, logit bias, stop token and logprobs params of ``raw``."""
    kw: dict[str, Any] = {}
    for key, (lo, hi) in _RANGES.items():
        if key in raw:
            name = names.get(key, key)
            number = _number(raw[key], name)
            if not lo <= number <= hi:
                raise _bad(name, f"{name} must be between {lo:g} and {hi:g}, got {number}")
            kw[key] = number
    if "repetition_penalty" in raw:
        name = names.get("repetition_penalty", "repetition_penalty")
        number = _number(raw["repetition_penalty"], name)
        if not number > 0:
            raise _bad(name, f"{name} must be > 0, got {number}")
        kw["repetition_penalty"] = number
    if "logit_bias" in raw:
        name = names.get("logit_bias", "logit_bias")
        bias = raw["logit_bias"]
        if not isinstance(bias, Mapping):
            raise _bad(name, f"{name} must be an object of token id -> bias, got {_got(bias)}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise _bad(name, f"{name} may hold at most {MAX_LOGIT_BIAS} entries")
        out: dict[int, float] = {}
        for key, value in bias.items():
            number = _number(value, name)
            if not -MAX_BIAS <= number <= MAX_BIAS:
                raise _bad(name, f"{name} biases must be between -100 and 100, got {number}")
            out[_token(key, name, limits)] = number
        kw["logit_bias"] = out
    if "stop_token_ids" in raw:
        name = names.get("stop_token_ids", "stop_token_ids")
        ids = raw["stop_token_ids"]
        if not isinstance(ids, list):
            raise _bad(name, f"{name} must be a list of token ids, got {_got(ids)}")
        if len(ids) > limits.max_stop_token_ids:
            message = f"{name} may hold at most {limits.max_stop_token_ids} token ids"
            raise _too_large(name, message)
        kw["stop_token_ids"] = [_token(t, name, limits) for t in ids]
    if raw.get("logprobs") is not None:
        name = names.get("logprobs", "logprobs")
        value = _integer(raw["logprobs"], name)
        if not 0 <= value <= MAX_TOP_LOGPROBS:
            raise _bad(name, f"{name} must be between 0 and {MAX_TOP_LOGPROBS}, got {value}")
        kw["logprobs"] = value
    return kw


def check_output_budget(
    max_tokens: int, top_logprobs: int | None, n: int, limits: Limits,
    names: Mapping[str, str] | None = None,
) -> None:  # fmt: skip
    """``too_large`` (up front) when ``n`` x ``max_tokens`` x (1 + ``top_logprobs``) token
    entries are over ``limits.max_output_entries``."""
    entries = n * max_tokens * (1 + (top_logprobs or 0))
    if entries > limits.max_output_entries:
        name = (names or {}).get("max_tokens", "max_tokens")
        parts = (f"n {n} x " if n > 1 else "") + f"{name} {max_tokens}" + (
            f" x (1 + top_logprobs {top_logprobs})" if top_logprobs else "")  # fmt: skip
        more = ", n or top_logprobs" if n > 1 or top_logprobs else ""
        raise _too_large(name, f"this request could return {entries} token entries ({parts}); "
                         f"the limit is {limits.max_output_entries} (--max-output-entries): "
                         f"lower {name}{more}")  # fmt: skip


def validate_detach_timeout(
    value: Any, limits: Limits, name: str = "detach_timeout"
) -> float | None:
    """A request's detach timeout in seconds (``None``: not given, the gateway's
    ``--detach-timeout`` applies), or ``bad_request`` naming ``name``: a number above 0
    and at most ``limits.max_detach_timeout`` (``--max-detach-timeout``)."""
    if value is None:
        return None
    seconds, most = _number(value, name), limits.max_detach_timeout
    if not 0 < seconds <= most:
        message = f"{name} must be above 0 and at most {most:g} seconds (--max-detach-timeout)"
        raise _bad(name, f"{message}, got {seconds}")
    return float(seconds)


# --- ids ----------------------------------------------------------------------------


def is_request_id(value: object, max_chars: int = MAX_REQUEST_ID) -> bool:
    """Whether ``value`` is a request id safe for headers and logs (1 to ``max_chars``)."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= min(max_chars, MAX_REQUEST_ID)
        and _REQUEST_ID_RE.fullmatch(value) is not None
    )


def validate_request_id(value: Any, limits: Limits, name: str = "request_id") -> str | None:
    """A client's request id (``None``: none given), or ``bad_request`` naming ``name``.

    One shape for every transport: 1 to ``limits.max_request_id`` (at most
    :data:`MAX_REQUEST_ID`) characters of :data:`REQUEST_ID_CHARS`, so that the
    id can go into an ``X-Request-Id`` header and a log line as it is.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(name, f"{name} must be a string, got {_got(value)}")
    most = min(limits.max_request_id, MAX_REQUEST_ID)
    if not is_request_id(value, most):
        raise _bad(name, f"{name} must be 1 to {most} characters of {REQUEST_ID_CHARS}")
    return value


def validate_resume_token(value: Any, name: str = "resume_token") -> str:
    """A resume token's shape (not whether it opens a stream), or ``bad_request``.

    1 to :data:`MAX_RESUME_TOKEN` characters of URL-safe base64: anything else
    cannot be a token this server issued, and is refused before it is hashed.
    """
    if not isinstance(value, str):
        raise _bad(name, f"{name} must be a string, got {_got(value)}")
    if not 0 < len(value) <= MAX_RESUME_TOKEN or not _RESUME_TOKEN_RE.fullmatch(value):
        message = f"{name} must be 1 to {MAX_RESUME_TOKEN} characters of A-Z, a-z, 0-9, '_', '-'"
        raise _bad(name, message)
    return value


# --- messages ---------------------------------------------------------------------


def validate_messages(
    raw: Any,
    limits: Limits,
    *,
    roles: Mapping[str, str] = ROLES,
    content: Callable[[Any, int, str], str | Parts] = parse_content,
) -> tuple[Message, ...]:
    """A chat's ``messages`` (``{"role", "content"}`` and tool fields) as :class:`Message` s.

    ``roles`` maps the role names the transport accepts to one of :data:`ROLES`;
    ``content(value, index, role)`` turns a message's content into text, or parts when
    it holds images (the default: a string or OpenAI's parts, core/wire/content.py), or
    raises :class:`RequestError`. The texts together must respect
    :func:`check_input_size`, the images :data:`core.wire.content.MAX_IMAGES` (none when
    ``limits.text_only``); core/wire/structured.py checks the tool fields.
    """
    if not isinstance(raw, list):
        raise _bad("messages", "messages must be a list")
    if not raw:
        raise _bad("messages", "messages must not be empty")
    if len(raw) > limits.max_messages:
        raise _too_large("messages", f"at most {limits.max_messages} messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise _bad("messages", f"messages[{i}] must be an object")
        role = m.get("role")
        if not isinstance(role, str) or role not in roles:
            field = f"messages[{i}].role"
            raise _bad(field, f"{field} must be one of {', '.join(roles)}")
        got = content(m.get("content"), i, role)
        parts = got if isinstance(got, tuple) else ()
        text = text_of(parts) if parts else str(got)
        try:  # an assistant's tool_calls, a tool message's tool_call_id
            out.append(Message(roles[role], text, message_tool_fields(m, i, roles[role]), parts))
        except ResponseFormatError as exc:
            raise RequestError(exc.code, str(exc), exc.field) from None
    check_input_size(sum(len(m.content) for m in out), limits)
    images = sum(1 for m in out for p in m.parts if p["type"] == "image_url")
    if images > MAX_IMAGES:
        message = f"{images} images; the limit is {MAX_IMAGES} a request"
        raise _bad("messages", message)
    if images and limits.text_only:  # (else a worker of ours refuses them)
        i = next(i for i, m in enumerate(out) if m.parts)
        raise _bad(f"messages[{i}].content", f"messages[{i}].content: {TEXT_ONLY}")
    return tuple(out)


def check_input_size(size: int, limits: Limits) -> None:
    """``too_large`` when a prompt (or all message contents) is over the limit."""
    if size > limits.max_input_chars:
        message = f"input is {size} characters; the limit is {limits.max_input_chars}"
        if (ctx := limits.context_tokens) is not None:
            message += f" ({CHARS_PER_TOKEN} per token of the model's {ctx}-token context)"
        raise _too_large(None, message)
