"""The names both sides of Redis and every transport share, as enums (sans I/O).

Each is a ``StrEnum``: a member *is* its string (``FinishReason.STOP == "stop"``), so it
goes on the wire, into Redis and into JSON as the same bytes as before; code compares
and produces members, never the bare strings.

- :class:`FinishReason`: why a stream (a choice) ended, the ``done`` event's ``r``
  field and every transport's ``finish_reason``. The engine's own outputs use the
  same names (an aborted sequence is ``cancelled``).
- :class:`ErrorCode`: a client-visible error (core/wire/errors.py has each code's
  HTTP status, OpenAI type and retry hint).
- :class:`EventKind`: a decoded stream-log event; :class:`StoredKind` is its one
  letter in the log.
- :class:`StreamStatus`: the ``st`` field of a stream's metadata hash.
"""

from __future__ import annotations

from enum import StrEnum


class FinishReason(StrEnum):
    """Why a stream ended (the ``done`` event, OpenAI's ``finish_reason``)."""

    STOP = "stop"  # end of sequence, a stop string or stop token
    LENGTH = "length"  # max_tokens, or the model's context
    TOOL_CALLS = "tool_calls"  # the answer is tool calls (parsed by the worker)
    CANCELLED = "cancelled"  # a client's cancel, or nobody re-attached in time
    ERROR = "error"  # the worker or the engine failed this stream
    EXPIRED = "expired"  # the stream outlived its time in the queue


class ErrorCode(StrEnum):
    """A protocol error code (docs/protocol.md, "`error`"; docs/api.md, "Errors")."""

    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    RATE_LIMITED = "rate_limited"
    TOO_LARGE = "too_large"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


class EventKind(StrEnum):
    """A stream-log event, decoded (core/wire/events.py)."""

    ACCEPTED = "accepted"  # seq 0: a worker took the request
    REJECTED = "rejected"  # seq 0: the worker refused it (code, message)
    TOKEN = "token"
    DONE = "done"
    UNKNOWN = "unknown"  # a kind this version does not know: readers skip it


class StoredKind(StrEnum):
    """The ``k`` field of a stream-log entry: one letter keeps entries small."""

    ACCEPTED = "a"
    TOKEN = "t"
    DONE = "d"
    REJECTED = "x"


class ToolFormat(StrEnum):
    """How a model family writes tool calls (core/wire/tool_formats.py)."""

    HERMES = "hermes"  # <tool_call>{json}</tool_call> (Qwen, SmolLM, Hermes)
    LLAMA3 = "llama3"  # {"name": ..., "parameters": ...} (Llama 3.x)
    MISTRAL = "mistral"  # [TOOL_CALLS][{...}]
    GRANITE = "granite"  # <|tool_call|>[{...}]


class StreamStatus(StrEnum):
    """The ``st`` field of a stream's metadata (``P m:{id}``)."""

    QUEUED = "queued"  # on a request queue, no worker yet
    RUNNING = "running"  # a worker accepted it
    DONE = "done"  # its done event is written
