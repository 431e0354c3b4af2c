"""OpenAI's streaming API as a relay speaks it, sans I/O: request bodies, events, chunks.

A worker request body (``messages`` or ``prompt``, and ``params``: the checked
:class:`core.wire.params.SamplingParams`) becomes a streaming
``/chat/completions`` or ``/completions`` body. Sampling fields go only when
they differ from the defaults, so an upstream that does not know an extension
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``: vLLM's names) never sees it unless a client asked for it.
``stream_options.include_usage`` asks for the usage chunk (the last one, with
empty ``choices``), which gives the stream's ``done`` event its token counts.

Each streamed ``data:`` JSON object becomes a :class:`Chunk`: the text delta
(``choices[0].delta.content`` for chat, ``choices[0].text`` for completions),
the finish reason mapped onto ours, the usage when present, or the error an
upstream sends in the stream (``{"error": {...}}``, as vLLM and tokenrelay do).

The chunks come as server-sent events (the WHATWG event-stream format):
``data: {json}`` events separated by blank lines, ending with ``data: [DONE]``,
with comments (``: keep-alive``, tokenrelay's gateway sends some) and ``id:``
lines between. :class:`SSEDecoder` takes the lines (without their line ends)
and gives back each event's data, multi-line data joined with ``\n``; event
names, ids and retry hints are read past. :class:`SSEStream` takes the body's
bytes as they arrive, splits them into lines (on ``\n``, ``\r\n`` and ``\r``
alike, a line end split across two reads included), decodes each line as UTF-8
and feeds the decoder.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.vocabulary import ErrorCode, FinishReason
from tokenrelay.worker.errors import Refused, Retryable, UpstreamError

# upstream finish reasons -> ours (core/wire/vocabulary.py); others: stop
UPSTREAM_REASONS: dict[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "eos_token": FinishReason.STOP,  # TGI
    "stop_sequence": FinishReason.STOP,  # TGI
    "length": FinishReason.LENGTH,
    "cancelled": FinishReason.CANCELLED,  # tokenrelay
    "expired": FinishReason.EXPIRED,  # tokenrelay
}
_DEFAULTS = SamplingParams()
MAX_ERROR_CHARS = 300
# the SamplingParams fields sampling_fields sends; any other one set is refused (unrelayed)
RELAYED = frozenset(
    ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "presence_penalty",
     "frequency_penalty", "min_p", "repetition_penalty", "logit_bias", "stop_token_ids",
     "ignore_eos", "response_format")
)  # fmt: skip


@dataclass
class Chunk:
    """What one streamed event carries (every field optional)."""

    text: str = ""
    finish_reason: FinishReason | None = None  # ours, mapped
    usage: tuple[int, int] | None = None  # (prompt_tokens, completion_tokens)
    error: str | None = None  # the upstream reported a failure in the stream
    done: bool = False  # ``[DONE]``


class SSEDecoder:
    """Accumulates ``data:`` lines; a blank line ends an event."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Take one line; the event's data when the line ends one (else ``None``)."""
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None  # a comment: a keep-alive
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        return None

    def close(self) -> str | None:
        """The stream ended: the data of an event it did not end with a blank line, if any.

        (The standard drops such an event; a server that forgets the last blank
        line still meant its ``[DONE]``.)
        """
        return self._dispatch()

    def _dispatch(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


class SSEStream:
    """Server-sent events from a body's bytes: the data of each event they complete."""

    def __init__(self) -> None:
        self.decoder = SSEDecoder()
        self._rest = b""  # the start of a line not ended yet
        self._cr = False  # the last byte was a CR: a LF right after it ends nothing

    def feed(self, data: bytes) -> list[str]:
        """Take the next bytes; the data of the events they end (often none or one)."""
        if self._cr:
            self._cr = False
            if data[:1] == b"\n":
                data = data[1:]
        buf = self._rest + data if self._rest else data
        if b"\r" in buf:
            self._cr = buf.endswith(b"\r")
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, self._rest = buf.split(b"\n")
        out = []
        feed = self.decoder.feed
        for line in lines:
            got = feed(line.decode("utf-8", "replace"))
            if got is not None:
                out.append(got)
        return out

    def close(self) -> str | None:
        """The body ended: what :meth:`SSEDecoder.close` gives, after a last unended line."""
        if self._rest:
            rest, self._rest = self._rest, b""
            got = self.decoder.feed(rest.decode("utf-8", "replace"))
            if got is not None:
                return got
        return self.decoder.close()


def request_body(
    body: dict[str, Any], params: SamplingParams, model: str | None, *, include_usage: bool
) -> tuple[str, dict[str, Any]]:
    """``(path, json)`` of the streaming call for a worker request ``body``."""
    out: dict[str, Any] = {}
    if model:
        out["model"] = model
    if "messages" in body:
        path = "/chat/completions"
        out["messages"] = body["messages"]
    else:
        path = "/completions"
        out["prompt"] = body.get("prompt")
    out["stream"] = True
    if include_usage:
        out["stream_options"] = {"include_usage": True}
    out.update(sampling_fields(params))
    return path, out


def sampling_fields(p: SamplingParams) -> dict[str, Any]:
    """The OpenAI (and vLLM extension) fields of ``p`` that differ from the defaults."""
    out: dict[str, Any] = {"max_tokens": p.max_tokens, "temperature": p.temperature}
    if p.top_p != _DEFAULTS.top_p:
        out["top_p"] = p.top_p
    if p.top_k > 0:
        out["top_k"] = p.top_k
    if p.seed is not None:
        out["seed"] = p.seed
    if p.stop:
        out["stop"] = list(p.stop)
    for name in ("presence_penalty", "frequency_penalty", "min_p", "repetition_penalty"):
        if getattr(p, name) != getattr(_DEFAULTS, name):
            out[name] = getattr(p, name)
    if p.logit_bias:
        out["logit_bias"] = {str(k): v for k, v in p.logit_bias.items()}
    if p.stop_token_ids:
        out["stop_token_ids"] = list(p.stop_token_ids)
    if p.ignore_eos:
        out["ignore_eos"] = True
    if p.response_format is not None:  # OpenAI's shape, normalised; vLLM takes it too
        out["response_format"] = p.response_format
    return out


def unrelayed(p: SamplingParams) -> list[str]:
    """The fields of ``p`` set to other than their defaults that a relay cannot pass on
    (logprobs, and any field added to SamplingParams since this module learnt its names):
    better a clear ``bad_request`` than an answer that silently ignores them."""
    return [
        f.name
        for f in dataclasses.fields(p)
        if f.name not in RELAYED and getattr(p, f.name) != getattr(_DEFAULTS, f.name)
    ]


def parse_chunk(data: str) -> Chunk:
    """One event's data as a :class:`Chunk`; ``ValueError`` for data that is not a chunk."""
    if data.strip() == "[DONE]":
        return Chunk(done=True)
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError("a streamed event is not a JSON object")
    if obj.get("error") is not None:
        return Chunk(error=error_message(obj) or "the upstream reported an error")
    out = Chunk(usage=_usage(obj.get("usage")))
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        out.text = text if isinstance(text, str) else ""
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and reason:
            out.finish_reason = UPSTREAM_REASONS.get(reason, FinishReason.STOP)
    return out


def _usage(raw: Any) -> tuple[int, int] | None:
    if not isinstance(raw, dict):
        return None
    prompt, completion = raw.get("prompt_tokens"), raw.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        return prompt, completion
    return None


def error_message(obj: Any) -> str | None:
    """The message of an error body: OpenAI's ``{"error": {"message"}}``, TGI's
    ``{"error": "..."}``, FastAPI's ``{"detail": ...}`` or ``{"message": ...}``."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if isinstance(err, dict):
        err = err.get("message")
    for value in (err, obj.get("message"), obj.get("detail")):
        if isinstance(value, str) and value:
            return value[:MAX_ERROR_CHARS]
        if value is not None and not isinstance(value, dict):
            return json.dumps(value)[:MAX_ERROR_CHARS]
    return None


def status_error(status: int, body: bytes, retry_after: float | None) -> UpstreamError:
    """The error for a non-200 answer to a streaming call (before any token)."""
    try:
        said = error_message(json.loads(body))
    except ValueError:
        said = None
    said = said or body.decode("utf-8", "replace").strip()[:MAX_ERROR_CHARS] or "no message"
    where = f"upstream answered HTTP {status}: {said}"
    if status == 429:
        return Retryable(ErrorCode.OVERLOADED, where, retry_after=retry_after)
    if status >= 500 or status == 408:
        return Retryable(ErrorCode.UNAVAILABLE, where, retry_after=retry_after)
    if status == 413:
        return Refused(ErrorCode.TOO_LARGE, where)
    if status in (401, 403, 404):  # the relay's key or model: not the client's doing
        return Refused(
            ErrorCode.UNAVAILABLE, where + " (check --upstream-api-key and --upstream-model)"
        )
    return Refused(ErrorCode.BAD_REQUEST, where)


def mentions_stream_options(error: UpstreamError) -> bool:
    """Whether a refusal is about ``stream_options`` (an upstream that does not take it)."""
    return error.code == ErrorCode.BAD_REQUEST and "stream_options" in error.message
