"""gRPC messages <-> protocol v1 frames, sans I/O.

A ``ClientFrame`` becomes the JSON object of the WebSocket frame it stands for
(:func:`client_frame_json`), which :func:`parse_client_frame` then parses and validates
with the WebSocket's own :func:`gateway.session.protocol.parse_frame`: one validator, one set
of error codes and messages. Server frames are built as the WebSocket's dicts
(gateway/session/protocol.py) and turned into a ``ServerFrame`` by :func:`server_frame`.
The JSON-text fields of the proto (``tools_json`` ...) carry what protocol v1 carries as
nested JSON. ``pb2`` is the generated module (gateway/grpc/generated.py).

The repeated fields of a ``Generate`` (``messages``, ``params.stop``, ``params.logit_bias``,
``params.stop_token_ids``) and its text sizes are checked against the WebSocket's
:class:`~core.wire.requests.Limits` first, on the message as it came
(:func:`check_sizes`): a frame of a million stop strings is refused by a length
comparison, before a list or dict of them exists. The error has the WebSocket's code for
that limit and names the proto's field.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tokenrelay.core.wire.params import MAX_LOGIT_BIAS
from tokenrelay.core.wire.vocabulary import ErrorCode
from tokenrelay.gateway.session import protocol as p

# SamplingParams fields with presence (proto3 `optional`): copied when set
_OPTIONAL_PARAMS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "seed",
    "ignore_eos",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "parallel_tool_calls",
    "n",
    "detach_timeout",  # not a SamplingParams field: protocol v1 takes it in params too
)
_JSON_PARAMS = {"response_format_json": "response_format", "tools_json": "tools",
                "tool_choice_json": "tool_choice"}  # fmt: skip


def _json_field(text: str, name: str, rid: str | None) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise p.ProtocolError(
            ErrorCode.BAD_REQUEST, f"{name} is not valid JSON: {exc}", request_id=rid
        ) from None


def _params(msg: Any, rid: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _OPTIONAL_PARAMS:
        if msg.HasField(name):
            value = getattr(msg, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise p.ProtocolError(
                    ErrorCode.BAD_REQUEST, f"{name} must be a finite number", request_id=rid
                )
            out[name] = value
    if msg.stop:
        out["stop"] = list(msg.stop)
    if msg.logit_bias:
        bias = dict(msg.logit_bias)
        if not all(math.isfinite(v) for v in bias.values()):
            raise p.ProtocolError(ErrorCode.BAD_REQUEST, "logit_bias must hold finite numbers",
                                  request_id=rid)  # fmt: skip
        out["logit_bias"] = {str(k): v for k, v in sorted(bias.items())}
    if msg.stop_token_ids:
        out["stop_token_ids"] = list(msg.stop_token_ids)
    for field, name in _JSON_PARAMS.items():
        text = getattr(msg, field)
        if text:
            out[name] = _json_field(text, f"params.{field}", rid)
    return out


def _message(m: Any, i: int, rid: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content if m.HasField("content") else None}
    if m.tool_calls_json:
        out["tool_calls"] = _json_field(m.tool_calls_json, f"messages[{i}].tool_calls_json", rid)
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _over(code: ErrorCode, message: str, rid: str | None) -> p.ProtocolError:
    return p.ProtocolError(code, message, request_id=rid)


def check_sizes(g: Any, limits: p.Limits) -> None:
    """Refuse a ``Generate`` whose repeated fields or texts are over ``limits`` (the
    WebSocket's), before anything is converted: counts first, then the lengths of at most
    that many items. The codes are the WebSocket's (``too_large``; ``bad_request`` for
    ``logit_bias``, as OpenAI's limit is checked there)."""
    rid = g.request_id or None
    if len(g.messages) > limits.max_messages:
        message = f"messages may hold at most {limits.max_messages} messages, got {len(g.messages)}"
        raise _over(ErrorCode.TOO_LARGE, message, rid)
    size = len(g.prompt) + sum(len(m.content) for m in g.messages)
    if size > limits.max_input_chars:
        message = f"input is {size} characters; the limit is {limits.max_input_chars}"
        raise _over(ErrorCode.TOO_LARGE, message, rid)
    if not g.HasField("params"):
        return
    params = g.params
    if len(params.stop) > limits.max_stop:
        message = f"params.stop may hold at most {limits.max_stop} strings, got {len(params.stop)}"
        raise _over(ErrorCode.TOO_LARGE, message, rid)
    if any(len(s) > limits.max_stop_chars for s in params.stop):
        message = f"params.stop strings are limited to {limits.max_stop_chars} characters"
        raise _over(ErrorCode.TOO_LARGE, message, rid)
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        most, got = limits.max_stop_token_ids, len(params.stop_token_ids)
        message = f"params.stop_token_ids may hold at most {most} token ids, got {got}"
        raise _over(ErrorCode.TOO_LARGE, message, rid)
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        got = len(params.logit_bias)
        message = f"params.logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {got}"
        raise _over(ErrorCode.BAD_REQUEST, message, rid)


def client_frame_json(frame: Any, limits: p.Limits | None = None) -> dict[str, Any]:
    """The protocol v1 frame (a JSON-able dict) that a ``ClientFrame`` stands for.

    An empty string is a field left out (proto3 cannot tell them apart). Raises
    :class:`~gateway.session.protocol.ProtocolError` for what JSON cannot carry (a JSON-text
    field that is not JSON, a non-finite number), an empty ``ClientFrame``, or a
    ``Generate`` over ``limits`` (:func:`check_sizes`; default: the WebSocket's defaults).
    """
    kind = frame.WhichOneof("frame")
    if kind == "generate":
        g = frame.generate
        check_sizes(g, limits or p.Limits())
        rid = g.request_id or None
        out: dict[str, Any] = {"type": "generate"}
        if g.request_id:
            out["request_id"] = g.request_id
        if g.messages:
            out["messages"] = [_message(m, i, rid) for i, m in enumerate(g.messages)]
        if g.prompt:
            out["prompt"] = g.prompt
        if g.HasField("params"):
            out["params"] = _params(g.params, rid)
        if g.model:
            out["model"] = g.model
        return out
    if kind in ("cancel", "resume"):
        msg = getattr(frame, kind)
        out = {"type": kind}
        if msg.stream_id:
            out["stream_id"] = msg.stream_id
        if msg.resume_token:
            out["resume_token"] = msg.resume_token
        if kind == "resume":
            out["after"] = msg.after
        return out
    if kind == "ping":
        return {"type": "ping"}
    raise p.ProtocolError(
        ErrorCode.BAD_REQUEST, "empty ClientFrame: set generate, cancel, resume or ping"
    )


def parse_client_frame(frame: Any, limits: p.Limits) -> p.ClientFrame:
    """A ``ClientFrame`` as the WebSocket's typed frame, validated by its own parser."""
    return p.parse_frame(p.encode(client_frame_json(frame, limits)), limits)


def server_frame(pb2: Any, frame: dict[str, Any]) -> Any:
    """The ``ServerFrame`` of a protocol v1 server frame (gateway/session/protocol.py's dicts)."""
    kind = frame["type"]
    if kind == "token":
        lp = frame.get("logprobs")
        logprobs_json = "" if lp is None else p.encode(lp)
        deltas = frame.get("tool_calls")
        token = pb2.Token(stream_id=frame["stream_id"], seq=frame["seq"], text=frame["text"],
                          logprobs_json=logprobs_json,
                          tool_calls_json="" if deltas is None else p.encode(deltas))  # fmt: skip
        return pb2.ServerFrame(token=token)
    if kind == "done":
        usage = pb2.Usage(**frame["usage"])
        calls = frame.get("tool_calls")
        done = pb2.Done(stream_id=frame["stream_id"], seq=frame["seq"],
                        finish_reason=frame["finish_reason"], usage=usage,
                        message=frame.get("message") or "",
                        tool_calls_json="" if calls is None else p.encode(calls))  # fmt: skip
        return pb2.ServerFrame(done=done)
    if kind == "started":
        started = pb2.Started(request_id=frame["request_id"] or "", stream_id=frame["stream_id"],
                              resume_token=frame["resume_token"],
                              prompt_tokens=frame["prompt_tokens"])  # fmt: skip
        if "index" in frame:
            started.index = frame["index"]
        return pb2.ServerFrame(started=started)
    if kind == "error":
        error = pb2.Error(code=frame["code"], message=frame["message"],
                          request_id=frame.get("request_id") or "",
                          stream_id=frame.get("stream_id") or "",
                          retry_after=int(frame.get("retry_after") or 0))  # fmt: skip
        return pb2.ServerFrame(error=error)
    if kind == "hello":
        fields = ("protocol", "heartbeat_s", "max_frame_bytes", "server", "worker_ready")
        detach = {f: frame[f] for f in ("detach_timeout", "max_detach_timeout") if f in frame}
        return pb2.ServerFrame(hello=pb2.Hello(**{f: frame[f] for f in fields}, **detach))
    if kind == "resumed":
        resumed = pb2.Resumed(stream_id=frame["stream_id"], after=frame["after"])
        return pb2.ServerFrame(resumed=resumed)
    if kind == "cancelled":
        cancelled = pb2.Cancelled(stream_id=frame["stream_id"], state=frame["state"],
                                  finish_reason=frame["finish_reason"] or "")  # fmt: skip
        return pb2.ServerFrame(cancelled=cancelled)
    if kind == "notice":
        notice = pb2.Notice(code=frame["code"], message=frame.get("message", ""),
                            drain_s=int(frame.get("drain_s") or 0))  # fmt: skip
        return pb2.ServerFrame(notice=notice)
    if kind == "pong":
        return pb2.ServerFrame(pong=pb2.Pong())
    raise ValueError(f"no ServerFrame for a {kind!r} frame")
