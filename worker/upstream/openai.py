"""OpenAI's streaming API as a relay speaks it, sans I/O: request bodies, events, chunks.

A worker request body (``messages`` or ``prompt``, and ``params``: the checked
:class:`core.wire.params.SamplingParams`) becomes a streaming
``/chat/completions`` or ``/completions`` body. Sampling fields go only when
they differ from the defaults, so an upstream that does not know an extension
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``: vLLM's names) never sees it unless a client asked for it.
``stream_options.include_usage`` asks for the usage chunk (the last one, with
empty ``choices``), which gives the stream's ``done`` event its token counts.
Logprobs and tools are passed on and read back as worker/upstream/features.py says.

Each streamed ``data:`` JSON object becomes a :class:`Chunk`: the text delta
(``choices[0].delta.content`` for chat, ``choices[0].text`` for completions),
its tokens' logprobs, its tool-call pieces, the finish reason mapped onto ours, the
usage when present, or the error an upstream sends in the stream (``{"error": {...}}``,
as vLLM and tokenrelay do).

The chunks come as server-sent events (the WHATWG event-stream format):
``data: {json}`` events separated by blank lines, ending with ``data: [DONE]``,
with comments (``: keep-alive``, tokenrelay's gateway sends some) and ``id:``
lines between. :class:`SSEDecoder` takes the lines (bytes, without their line
ends) and gives back each event's data, multi-line data joined with ``\n`` and
decoded as UTF-8; event names, ids and retry hints are read past.
:class:`SSEStream` takes the body's bytes as they arrive and splits them into
lines (on ``\n``, ``\r\n`` and ``\r`` alike, a line end split across two reads
included), looking at each byte once: the start of a line not ended yet waits in
a buffer that only grows, and is never scanned again.

An upstream is not trusted to be sane: a line over :data:`MAX_LINE` bytes, an
event's data over :data:`MAX_EVENT` bytes, more than :data:`MAX_IDLE_RUN` lines
in a row that carry nothing (comments, blank lines, fields without data) or more
than :data:`MAX_IDLE_LINES` comment and blank lines in one answer raise
``ValueError`` with a one-line message (the call ends the stream with it), so
neither memory nor a keep-alive trickle grows without end.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from tokenrelay.core.wire.logprobs import Logprobs
from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.vocabulary import ErrorCode, FinishReason
from tokenrelay.worker.errors import Refused, Retryable, UpstreamError
from tokenrelay.worker.upstream.features import (
    RawDelta,
    chunk_calls,
    chunk_logprobs,
    logprob_fields,
    tool_fields,
)

# upstream finish reasons -> ours (core/wire/vocabulary.py); others: stop
UPSTREAM_REASONS: dict[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "eos_token": FinishReason.STOP,  # TGI
    "stop_sequence": FinishReason.STOP,  # TGI
    "length": FinishReason.LENGTH,
    "cancelled": FinishReason.CANCELLED,  # tokenrelay
    "expired": FinishReason.EXPIRED,  # tokenrelay
    "tool_calls": FinishReason.TOOL_CALLS,
    "function_call": FinishReason.TOOL_CALLS,  # OpenAI's older name
}
_DEFAULTS = SamplingParams()
MAX_ERROR_CHARS = 300
# the SamplingParams fields sampling_fields sends; any other one set is refused (unrelayed)
RELAYED = frozenset(
    ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "presence_penalty",
     "frequency_penalty", "min_p", "repetition_penalty", "logit_bias", "stop_token_ids",
     "ignore_eos", "response_format", "logprobs", "tools", "tool_choice",
     "parallel_tool_calls")
)  # fmt: skip
CHAT_ONLY = frozenset(("tools", "tool_choice", "parallel_tool_calls"))  # not on /completions


@dataclass
class Chunk:
    """What one streamed event carries (every field optional)."""

    text: str = ""
    finish_reason: FinishReason | None = None  # ours, mapped
    usage: tuple[int, int] | None = None  # (prompt_tokens, completion_tokens)
    error: str | None = None  # the upstream reported a failure in the stream
    refusal: ErrorCode | None = None  # ... one that refuses the request (refusal_code)
    done: bool = False  # ``[DONE]``
    logprobs: list[Logprobs] = field(default_factory=list)  # of the tokens of ``text``
    calls: list[RawDelta] = field(default_factory=list)  # tool-call pieces (features.py)


MAX_LINE = 1 << 20  # bytes of one line of the event stream
MAX_EVENT = 1 << 20  # bytes of one event's data (its data lines and their line ends)
MAX_IDLE_RUN = 1_000  # lines in a row that carry nothing (comments, blanks, other fields)
MAX_IDLE_LINES = 10_000  # comment and blank (or empty data) lines in one answer


class SSEDecoder:
    """Accumulates ``data:`` lines; a blank line ends an event. Caps what it keeps and
    how long it reads nothing (``ValueError`` past a cap)."""

    def __init__(
        self,
        *,
        max_event: int = MAX_EVENT,
        max_idle_run: int = MAX_IDLE_RUN,
        max_idle_lines: int = MAX_IDLE_LINES,
    ) -> None:
        self.max_event = max_event
        self.max_idle_run = max_idle_run
        self.max_idle_lines = max_idle_lines
        self._data: list[bytes] = []
        self._size = 0  # bytes of the event so far (data and one line end each)
        self._run = 0  # lines since the last event
        self.idle = 0  # comment and blank lines so far

    def feed(self, line: bytes) -> str | None:
        """Take one line; the event's data when the line ends one (else ``None``)."""
        if not line:
            if self._data:
                return self._dispatch()
            self._idle()
            return None
        if line[:1] == b":":
            self._idle()  # a comment: a keep-alive
            return None
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name != b"data":
            self._run += 1  # id, event, retry: read past
            if self._run > self.max_idle_run:
                raise ValueError(self._run_said())
            return None
        if not value:
            self._idle()
        self._size += len(value) + 1
        if self._size > self.max_event:
            raise ValueError(f"upstream sent an event over {self.max_event} bytes")
        self._data.append(value)
        return None

    def close(self) -> str | None:
        """The stream ended: the data of an event it did not end with a blank line, if any.

        (The standard drops such an event; a server that forgets the last blank
        line still meant its ``[DONE]``.)
        """
        return self._dispatch()

    def _idle(self) -> None:
        self._run += 1
        self.idle += 1
        if self._run > self.max_idle_run:
            raise ValueError(self._run_said())
        if self.idle > self.max_idle_lines:
            raise ValueError(f"upstream sent over {self.max_idle_lines} comment or blank lines")

    def _run_said(self) -> str:
        return f"upstream sent over {self.max_idle_run} lines in a row without an event"

    def _dispatch(self) -> str | None:
        self._run = 0
        if not self._data:
            return None
        data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
        self._data, self._size = [], 0
        return data.decode("utf-8", "replace")


class SSEStream:
    """Server-sent events from a body's bytes: the data of each event they complete."""

    def __init__(
        self,
        *,
        max_line: int = MAX_LINE,
        max_event: int = MAX_EVENT,
        max_idle_run: int = MAX_IDLE_RUN,
        max_idle_lines: int = MAX_IDLE_LINES,
    ) -> None:
        self.decoder = SSEDecoder(max_event=max_event, max_idle_run=max_idle_run,
                                  max_idle_lines=max_idle_lines)  # fmt: skip
        self.max_line = max_line
        self._rest = bytearray()  # the start of a line not ended yet (appended to, not rebuilt)
        self._cr = False  # the last byte was a CR: a LF right after it ends nothing

    def feed(self, data: bytes) -> list[str]:
        """Take the next bytes; the data of the events they end (often none or one).

        ``ValueError`` when they make a line longer than ``max_line`` bytes or break a
        cap of the decoder's.
        """
        if self._cr:
            self._cr = False
            if data[:1] == b"\n":
                data = data[1:]
        if b"\r" in data:  # (only the new bytes: the buffered ones hold no line end)
            self._cr = data.endswith(b"\r")
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        rest = self._rest
        if b"\n" not in data:
            rest += data
            if len(rest) > self.max_line:
                raise ValueError(f"upstream sent a line over {self.max_line} bytes")
            return []
        lines = data.split(b"\n")
        if rest:
            rest += lines[0]
            lines[0] = bytes(rest)
            del rest[:]
        rest += lines.pop()
        if len(lines[0]) + len(data) + len(rest) > self.max_line and (
            len(rest) > self.max_line or max(map(len, lines)) > self.max_line
        ):
            raise ValueError(f"upstream sent a line over {self.max_line} bytes")
        out = []
        feed = self.decoder.feed
        for line in lines:
            got = feed(line)
            if got is not None:
                out.append(got)
        return out

    def close(self) -> str | None:
        """The body ended: what :meth:`SSEDecoder.close` gives, after a last unended line."""
        if self._rest:
            rest = bytes(self._rest)
            del self._rest[:]
            got = self.decoder.feed(rest)
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
    out.update(logprob_fields(params, chat=path == "/chat/completions"))
    if path == "/chat/completions":
        out.update(tool_fields(params))
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


def unrelayed(p: SamplingParams, *, chat: bool = True) -> list[str]:
    """The fields of ``p`` set to other than their defaults that a relay cannot pass on
    (tools to ``/completions``, and any field added to SamplingParams since this module
    learnt its names): better a clear ``bad_request`` than an answer that silently
    ignores them."""
    passed = RELAYED if chat else RELAYED - CHAT_ONLY
    return [
        f.name
        for f in dataclasses.fields(p)
        if f.name not in passed and getattr(p, f.name) != getattr(_DEFAULTS, f.name)
    ]


def parse_chunk(data: str) -> Chunk:
    """One event's data as a :class:`Chunk`; ``ValueError`` for data that is not a chunk."""
    if data.strip() == "[DONE]":
        return Chunk(done=True)
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError("a streamed event is not a JSON object")
    if obj.get("error") is not None:
        said = error_message(obj) or "the upstream reported an error"
        return Chunk(error=said, refusal=refusal_code(obj["error"]))
    out = Chunk(usage=_usage(obj.get("usage")))
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        out.text = text if isinstance(text, str) else ""
        out.logprobs = chunk_logprobs(choice.get("logprobs"))
        out.calls = chunk_calls(delta)
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


def refusal_code(err: Any) -> ErrorCode | None:
    """The code of an in-stream error that refuses the request, as its HTTP answer would
    (``{"error": {"code": 400}}``, vLLM's and llama.cpp's; tokenrelay's codes; an
    ``invalid_request_error``): ``bad_request``, or ``too_large`` for a 413; None for any
    other error, which another attempt may not meet."""
    if not isinstance(err, dict):
        return None
    code = err.get("code")
    if isinstance(code, str) and code.isdecimal():
        code = int(code)
    if type(code) is int and 400 <= code < 500 and code not in (401, 403, 404, 408, 429):
        return ErrorCode.TOO_LARGE if code == 413 else ErrorCode.BAD_REQUEST
    if code in (ErrorCode.BAD_REQUEST, ErrorCode.TOO_LARGE):  # a tokenrelay upstream's
        return ErrorCode(code)
    if err.get("type") in ("invalid_request_error", "BadRequestError"):
        return ErrorCode.BAD_REQUEST
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
