"""The upstream server a relay worker calls, from ``--upstream`` and its companions.

``--upstream`` is the server's OpenAI base URL, as an OpenAI SDK's ``base_url``
(``http://127.0.0.1:8000/v1``); a URL with no path gets ``/v1``. The requests go
to ``{base}/chat/completions`` (a request with ``messages``) or
``{base}/completions`` (one with a ``prompt``), the model list to ``{base}/models``.

The relay serves, under the names it announces to gateways (core/wire/stats.py
``models``): the ``--upstream-model`` names (a comma list), or one of them under the
worker's ``--model-name``, or else every model the upstream lists.

Each call has deadlines besides ``--upstream-timeout`` (the longest silence between two
reads), all counted from the moment its request goes out: the response headers within
``head_timeout``, the first text within ``first_token_timeout``, the whole answer within
``total_timeout``; an upstream that keeps a connection busy with keep-alive comments or
a trickle of header bytes meets one of them. The server-sent events it reads are capped
too (worker/upstream/openai.py): ``max_line_bytes`` a line, ``max_event_bytes`` an
event's data, ``max_idle_run`` lines in a row that carry nothing (comments, blank lines,
fields without data), ``max_idle_lines`` comment and blank lines in one answer.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from tokenrelay.core.options import MAX_INFLIGHT as DEFAULT_MAX_INFLIGHT
from tokenrelay.core.options import UPSTREAM_TIMEOUT as DEFAULT_TIMEOUT
from tokenrelay.core.wire.stats import checked_models, model_names
from tokenrelay.worker.upstream.openai import MAX_EVENT, MAX_IDLE_LINES, MAX_IDLE_RUN, MAX_LINE

CONNECT_TIMEOUT = 10.0  # at most, for the TCP (and TLS) handshake
HEAD_TIMEOUT = 60.0  # seconds from a request to its response headers
FIRST_TOKEN_TIMEOUT = 300.0  # seconds from a request to its first text (queue, prefill)
TOTAL_TIMEOUT = 3600.0  # seconds from a request to the end of its answer
MIN_CAP_BYTES = 1024  # the smallest line or event cap: room for any ordinary chunk


def base_url(raw: str) -> str:
    """``raw`` checked and normalised: http(s), a host, no query; ``/v1`` when no path.

    Raises ``ValueError`` with one line naming the flag.
    """
    parts = urlsplit(raw.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        example = "http://host:8000/v1"
        raise ValueError(f"--upstream must be an http(s) URL such as {example}, got {raw!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"--upstream takes a base URL without a query or fragment, got {raw!r}")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError:
        raise ValueError(f"--upstream has a bad port: {raw!r}") from None
    path = parts.path.rstrip("/") or "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def redact(url: str) -> str:
    """``url`` without a password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@dataclass(frozen=True)
class UpstreamConfig:
    """How to reach the upstream and how far to trust it."""

    url: str  # the base URL, normalised (base_url)
    model: str | None = None  # the model name sent upstream; None: its first listed model
    models: tuple[str, ...] = ()  # every --upstream-model name (model is the first)
    served_name: str | None = None  # --model-name: the one model's name for clients
    api_key: str | None = field(default=None, repr=False)  # ``Authorization: Bearer``; never logged
    timeout: float = DEFAULT_TIMEOUT  # no byte for this long: the call fails
    max_inflight: int = DEFAULT_MAX_INFLIGHT  # calls at once (the worker takes no more)
    head_timeout: float = HEAD_TIMEOUT  # request sent -> response headers in
    first_token_timeout: float = FIRST_TOKEN_TIMEOUT  # request sent -> first text in
    total_timeout: float = TOTAL_TIMEOUT  # request sent -> the answer's end
    max_line_bytes: int = MAX_LINE  # one line of the event stream
    max_event_bytes: int = MAX_EVENT  # one event's data (its data lines together)
    max_idle_run: int = MAX_IDLE_RUN  # lines in a row that carry nothing
    max_idle_lines: int = MAX_IDLE_LINES  # comment and blank lines in one answer

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"--upstream-timeout must be > 0 seconds, got {self.timeout}")
        self._check_deadlines()
        self._check_caps()
        if self.max_inflight < 1:
            raise ValueError(f"--max-inflight must be at least 1, got {self.max_inflight}")
        if self.model is not None and not self.models:
            object.__setattr__(self, "models", (self.model,))
        checked_models(list(self.models), "--upstream-model")
        if self.served_name is not None:
            checked_models([self.served_name], "--model-name")
            if len(self.models) > 1:
                raise ValueError(
                    "--model-name names one model; a relay of several --upstream-model "
                    "names serves each under its own name"
                )

    def _check_deadlines(self) -> None:
        names = ("head_timeout", "first_token_timeout", "total_timeout")
        values = [getattr(self, n) for n in names]
        for name, value in zip(names, values, strict=True):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"upstream {name} must be a number of seconds, got {value!r}")
            if not 0 < value < math.inf:
                raise ValueError(f"upstream {name} must be > 0 seconds and finite, got {value}")
        if not values[0] <= values[1] <= values[2]:
            raise ValueError(
                "upstream deadlines must grow: head_timeout <= first_token_timeout <= "
                f"total_timeout, got {values[0]:g} / {values[1]:g} / {values[2]:g} s"
            )

    def _check_caps(self) -> None:
        least = {"max_line_bytes": MIN_CAP_BYTES, "max_event_bytes": MIN_CAP_BYTES,
                 "max_idle_run": 1, "max_idle_lines": 1}  # fmt: skip
        for name, low in least.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"upstream {name} must be an integer >= {low}, got {value!r}")

    def announced(self, listed: list[str] | None) -> list[str] | None:
        """The model names clients use, given the upstream's list (``None``: not known yet)."""
        if self.served_name is not None:
            return [self.served_name]
        names = list(self.models) or listed
        return None if names is None else model_names(names)

    def upstream_name(self, served: str | None, listed: list[str] | None) -> str | None:
        """The name sent upstream for a request for the model ``served`` (``None``: the
        request names none, and the first model is meant)."""
        if served is None or served == self.served_name:
            return self.model or (listed[0] if listed else None)
        return served

    @property
    def connect_timeout(self) -> float:
        return min(CONNECT_TIMEOUT, self.timeout)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> UpstreamConfig:
        """The upstream of ``tokenrelay worker``/``serve``'s options; ``ValueError`` if bad."""
        names = [n.strip() for n in (getattr(args, "upstream_model", None) or "").split(",")]
        models = tuple(n for n in names if n)
        return cls(
            url=base_url(args.upstream),
            model=models[0] if models else None,
            models=models,
            served_name=getattr(args, "model_name", None) or None,
            api_key=getattr(args, "upstream_api_key", None) or None,
            timeout=float(getattr(args, "upstream_timeout", DEFAULT_TIMEOUT)),
            max_inflight=int(getattr(args, "max_inflight", DEFAULT_MAX_INFLIGHT)),
        )

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
