"""What a relay passes on beyond sampling, and reads back from the chunks, sans I/O.

Offered ``tools`` go upstream with ``tool_choice`` and ``parallel_tool_calls`` (as the
gateway checked and normalised them), and the upstream's streamed
``choices[0].delta.tool_calls`` come back as :class:`core.wire.tools.CallDelta` s, the
deltas the engine worker stores on its token events: :class:`CallReader` numbers the
calls from 0 in the order they start (the ids clients see are ours,
:func:`core.wire.tools.call_id`), sends a call's name with its first delta (arguments
an upstream sends before the name wait for it) and joins each call's ``arguments``
fragments for the ``done`` event. Past :data:`core.wire.tools.MAX_CALLS` calls or
:data:`core.wire.tools.MAX_CALL_CHARS` characters of one call's arguments it raises
``ValueError``, which ends the stream as any other cap of the relay's does.

Asked for, a request's ``logprobs`` go upstream in the endpoint's own shape (chat:
``logprobs: true`` and ``top_logprobs``; completions: ``logprobs`` as the count), and
each chunk's logprobs come back as :class:`core.wire.logprobs.Logprobs`, the values the
engine worker stores on its token events: chat's ``choices[0].logprobs.content`` items
(``token``, ``logprob``, ``bytes``, ``top_logprobs``) or completions'
``choices[0].logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs`` as text ->
logprob; the chosen token's exact bytes are then its text's UTF-8). An item that is not
one (no string token, no number) is read past; a chunk's items are capped at
:data:`MAX_CHUNK_LOGPROBS` and each token's alternatives at
:data:`core.wire.params.MAX_TOP_LOGPROBS`.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tokenrelay.core.wire.logprobs import LOGPROB_FLOOR, Logprobs, TokenLogprob
from tokenrelay.core.wire.params import MAX_TOP_LOGPROBS, SamplingParams
from tokenrelay.core.wire.tools import MAX_CALL_CHARS, MAX_CALLS, CallDelta, ToolCall, call_id

MAX_CHUNK_LOGPROBS = 4096  # tokens' logprobs read from one chunk, at most


def logprob_fields(p: SamplingParams, chat: bool) -> dict[str, Any]:
    """The fields that ask the upstream for ``p``'s logprobs (none when not asked)."""
    if p.logprobs is None:
        return {}
    if chat:
        return {"logprobs": True, "top_logprobs": p.logprobs}
    return {"logprobs": p.logprobs}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return LOGPROB_FLOOR if math.isnan(value) else max(value, LOGPROB_FLOOR)


def _raw(token: str, raw: Any) -> bytes:
    """A token's exact bytes: the upstream's ``bytes`` when they are bytes, else its UTF-8."""
    if isinstance(raw, list) and all(type(b) is int and 0 <= b < 256 for b in raw):
        return bytes(raw)
    return token.encode("utf-8", "surrogatepass")


def _item(raw: Any) -> TokenLogprob | None:
    """A chat logprob item (``token``, ``logprob``, ``bytes``), or None when not one."""
    if not isinstance(raw, dict) or not isinstance(token := raw.get("token"), str):
        return None
    value = _number(raw.get("logprob"))
    return None if value is None else TokenLogprob(token, value, _raw(token, raw.get("bytes")))


def _chat_entry(raw: Any) -> Logprobs | None:
    chosen = _item(raw)
    if chosen is None:
        return None
    tops = raw.get("top_logprobs")
    if not isinstance(tops, list):
        return Logprobs(chosen)
    return Logprobs(chosen, tuple(t for t in map(_item, tops[:MAX_TOP_LOGPROBS]) if t))


def _completion_entries(raw: dict[str, Any]) -> list[Logprobs]:
    tokens, values, tops = raw.get("tokens"), raw.get("token_logprobs"), raw.get("top_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list):
        return []
    out = []
    for i, token in enumerate(tokens[:MAX_CHUNK_LOGPROBS]):
        value = _number(values[i]) if i < len(values) else None
        if not isinstance(token, str) or value is None:
            continue
        top_raw = tops[i] if isinstance(tops, list) and i < len(tops) else None
        top = []
        if isinstance(top_raw, dict):
            ranked = [(t, n) for t, v in top_raw.items() if (n := _number(v)) is not None]
            ranked.sort(key=lambda tn: -tn[1])
            top = [TokenLogprob(t, n, _raw(t, None)) for t, n in ranked[:MAX_TOP_LOGPROBS]]
        out.append(Logprobs(TokenLogprob(token, value, _raw(token, None)), tuple(top)))
    return out


def chunk_logprobs(raw: Any) -> list[Logprobs]:
    """The logprobs of a chunk's ``choices[0].logprobs`` (chat's or completions' shape)."""
    if not isinstance(raw, dict):
        return []
    content = raw.get("content")
    if isinstance(content, list):
        entries = map(_chat_entry, content[:MAX_CHUNK_LOGPROBS])
        return [e for e in entries if e is not None]
    return _completion_entries(raw)


def top_at_most(entries: list[Logprobs], k: int) -> list[Logprobs]:
    """``entries`` with at most ``k`` alternatives each (the request's ``top_logprobs``:
    a completions' ``top_logprobs`` also holds the chosen token past the top ``k``)."""
    return [e if len(e.top) <= k else Logprobs(e.chosen, e.top[:k]) for e in entries]


# --- tool calls -------------------------------------------------------------------------

RawDelta = tuple[int | None, str | None, str]  # (the upstream's index, name, arguments)


def tool_fields(p: SamplingParams) -> dict[str, Any]:
    """The fields that offer ``p``'s tools upstream (none when it offers none)."""
    if not p.tools:
        return {}
    out: dict[str, Any] = {"tools": p.tools, "tool_choice": p.tool_choice}
    if not p.parallel_tool_calls:
        out["parallel_tool_calls"] = False
    return out


def chunk_calls(delta: Any) -> list[RawDelta]:
    """The tool-call pieces of a chunk's ``choices[0].delta`` (``tool_calls``): what is not
    an object is read past; ``arguments`` sent as an object are its JSON text."""
    raw = delta.get("tool_calls") if isinstance(delta, dict) else None
    if not isinstance(raw, list):
        return []
    out: list[RawDelta] = []
    for item in raw[:MAX_CALLS]:
        if not isinstance(item, dict):
            continue
        index = item.get("index")
        fn = item.get("function")
        fn = fn if isinstance(fn, dict) else {}
        name, args = fn.get("name"), fn.get("arguments")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        out.append((index if type(index) is int and index >= 0 else None,
                    name if isinstance(name, str) and name else None,
                    args if isinstance(args, str) else ""))  # fmt: skip
    return out


class CallReader:
    """One answer's calls as the upstream streams them (see the module doc)."""

    def __init__(self) -> None:
        self._ours: dict[int | None, int] = {}  # the upstream's index -> ours
        self._names: list[str] = []
        self._args: list[list[str]] = []
        self._sizes: list[int] = []
        self._held: dict[int | None, str] = {}  # arguments sent before their call's name

    def feed(self, pieces: list[RawDelta]) -> list[CallDelta]:
        """The deltas of one chunk's pieces; ``ValueError`` past a cap."""
        out: list[CallDelta] = []
        for key, name, args in pieces:
            if key is None and name is None and self._names:
                key = next(reversed(self._ours))  # no index: the call going on
            ours = self._ours.get(key)
            if ours is None and name is None:  # no name yet: held
                held = self._held.get(key, "") + args
                if len(held) > MAX_CALL_CHARS:
                    raise ValueError(f"upstream sent a tool call over {MAX_CALL_CHARS} characters")
                self._held[key] = held
                continue
            if ours is None:  # a new call (one without an index: each one named)
                if len(self._names) >= MAX_CALLS:
                    raise ValueError(f"upstream sent over {MAX_CALLS} tool calls")
                ours = len(self._names)
                self._ours[key if key is not None else -1 - ours] = ours
                self._names.append(str(name))
                self._args.append([])
                self._sizes.append(0)
                args = self._held.pop(key, "") + args
                out.append(CallDelta(ours, name, args))
            elif args:
                out.append(CallDelta(ours, None, args))
            else:
                continue
            self._sizes[ours] += len(args)
            if self._sizes[ours] > MAX_CALL_CHARS:
                raise ValueError(f"upstream sent a tool call over {MAX_CALL_CHARS} characters")
            self._args[ours].append(args)
        return out

    def calls(self, stream_id: str) -> tuple[ToolCall, ...]:
        """The calls so far, for the ``done`` event (``{}`` for arguments never sent)."""
        return tuple(
            ToolCall(call_id(stream_id, i), name, "".join(args) or "{}")
            for i, (name, args) in enumerate(zip(self._names, self._args, strict=True))
        )
