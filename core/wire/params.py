"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenrelay.core.wire.response_format import ResponseFormat, parse_response_format
from tokenrelay.core.wire.tools import (
    Tool,
    ToolChoice,
    call_grammar,
    parse_tool_choice,
    parse_tools,
)
from tokenrelay.core.wire.vocabulary import ToolFormat

MAX_TOP_LOGPROBS = 20  # the most alternatives a token's logprobs carry (OpenAI's top_logprobs)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
MAX_BIAS = 100.0  # |bias| of one logit_bias entry
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_CHOICES = 16  # n: choices per request, each a stream of its own (not a SamplingParams field)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _token_id(key: object, name: str) -> int:
    """A token id given as an int or, as JSON object keys are, a decimal string."""
    if isinstance(key, str) and key.isascii() and key.isdecimal():
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, int) or key < 0:
        raise ValueError(f"{name}: token ids must be non-negative integers, got {key!r}")
    return key


@dataclass
class SamplingParams:
    """How to sample one completion.

    ``temperature`` 0 means greedy. ``top_k`` 0 (or -1) disables top-k; ``min_p``
    keeps the tokens at least ``min_p`` times as likely as the most likely one.
    ``seed`` makes sampling reproducible whatever else shares the batch.
    ``stop`` strings end the completion and never appear in its text;
    ``stop_token_ids`` end it too (their text stays, unless a special token's).

    Penalties (vLLM's semantics, applied before temperature): ``logit_bias``
    (token id -> bias added to its logit), then ``repetition_penalty`` (a logit
    of a token seen in the prompt or the output is divided by it when positive,
    multiplied when negative), then ``frequency_penalty`` times the token's count
    in the output and ``presence_penalty`` once if it is there are subtracted.
    They change greedy decoding too.

    ``logprobs``: ``None`` for none, else each generated token's log-probability
    (of the model's raw logits) with that many most likely alternatives (0-20).

    ``response_format``: the OpenAI shape (``{"type": "json_object"}``,
    ``{"type": "json_schema", "json_schema": {...}}``; ``{"type": "text"}`` or
    ``None`` for free text), checked and kept normalised; :attr:`guided` is the
    parsed :class:`~core.wire.response_format.ResponseFormat` the engine compiles.

    ``tools``, ``tool_choice`` and ``parallel_tool_calls``: OpenAI's tool calls
    (core/wire/tools.py): the chat template shows the tools, ``required`` or a named
    function constrain the output to calls (then :attr:`guided` is their grammar),
    and the finished text's calls are parsed. Not with a ``response_format``.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature >= 0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a list of strings")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        if self.top_k == -1:
            self.top_k = 0
        self._check_penalties()
        self.logit_bias = _logit_bias(self.logit_bias)
        if not isinstance(self.stop_token_ids, list | tuple):
            raise ValueError("stop_token_ids must be a list of integers")
        self.stop_token_ids = [_token_id(t, "stop_token_ids") for t in self.stop_token_ids]
        lp = self.logprobs
        if lp is not None and (
            isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_TOP_LOGPROBS
        ):
            raise ValueError(f"logprobs must be null or 0 to {MAX_TOP_LOGPROBS}, got {lp!r}")
        fmt = parse_response_format(self.response_format)  # ResponseFormatError: a ValueError
        self.response_format = None if fmt is None else fmt.to_dict()
        self.__dict__["_guided"] = fmt  # not a field: PARAM_NAMES and asdict leave it out
        if fmt is not None and self.ignore_eos:
            raise ValueError("ignore_eos: cannot be combined with a response_format")
        self._check_tools(fmt)

    def _check_tools(self, fmt: ResponseFormat | None) -> None:
        tools = parse_tools(self.tools)  # ToolError: a ValueError
        choice = parse_tool_choice(self.tool_choice, tools)
        if not isinstance(self.parallel_tool_calls, bool):
            raise ValueError("parallel_tool_calls must be a boolean")
        self.tools = [t.to_dict() for t in tools] or None
        self.tool_choice = choice.to_value() if tools else None
        self.__dict__["_tools"] = (tools, choice)
        if not choice.constrained:
            return
        if fmt is not None:
            raise ValueError("response_format: cannot be combined with tools")
        if self.ignore_eos:
            raise ValueError("ignore_eos: cannot be combined with a required tool call")
        grammar = call_grammar(tools, choice, self.parallel_tool_calls)
        self.__dict__["_guided"] = ResponseFormat("tool_calls", grammar)

    def _check_penalties(self) -> None:
        ranges: dict[str, tuple[float, float]] = {
            "min_p": (0.0, 1.0),
            "presence_penalty": (-MAX_PENALTY, MAX_PENALTY),
            "frequency_penalty": (-MAX_PENALTY, MAX_PENALTY),
        }
        for name, (lo, hi) in ranges.items():
            value = getattr(self, name)
            if not _is_number(value) or not lo <= value <= hi:
                raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r}")
            setattr(self, name, float(value))
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0 < rp < math.inf:
            raise ValueError(f"repetition_penalty must be a number > 0, got {rp!r}")
        self.repetition_penalty = float(rp)

    @property
    def guided(self) -> ResponseFormat | None:
        """The grammar: the parsed ``response_format``, or a ``tool_calls`` one whose
        ``schema`` is the Lark text of the calls ``tool_choice`` requires (None: free)."""
        fmt: ResponseFormat | None = self.__dict__.get("_guided")
        return fmt

    def guided_for(self, fmt: ToolFormat) -> ResponseFormat | None:
        """:attr:`guided`, with the calls a ``tool_choice`` requires written the way a
        model of ``fmt`` writes them (core/wire/tool_formats.py)."""
        guided = self.guided
        if guided is None or guided.type != "tool_calls" or fmt == ToolFormat.HERMES:
            return guided
        tools, choice = self.__dict__["_tools"]
        grammar = call_grammar(tools, choice, self.parallel_tool_calls, fmt)
        return ResponseFormat("tool_calls", grammar)

    @property
    def offered_tools(self) -> tuple[Tool, ...]:
        """The tools shown to the model and parsed from its text (none for ``none``)."""
        tools, choice = self.__dict__.get("_tools") or ((), ToolChoice("none"))
        return () if choice.mode == "none" else tuple(tools)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_history(self) -> bool:
        """Whether sampling reads the tokens so far (a penalty is on)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def edits_logits(self) -> bool:
        """Whether the logits change before sampling (a penalty or a logit bias)."""
        return self.uses_history or bool(self.logit_bias)


def _logit_bias(raw: Any) -> dict[int, float]:
    if not isinstance(raw, Mapping):
        raise ValueError(f"logit_bias must be an object of token id -> bias, got {raw!r}")
    if len(raw) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(raw)}")
    out: dict[int, float] = {}
    for key, bias in raw.items():
        token = _token_id(key, "logit_bias")
        if not _is_number(bias) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise ValueError(f"logit_bias: biases must be numbers in [-100, 100], got {bias!r}")
        out[token] = float(bias)
    return out
