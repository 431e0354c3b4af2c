"""What a worker needs of an engine: the :class:`EngineClient` protocol, and our engine behind it.

:class:`worker.main.Worker` drives any object with these methods, one step at a
time, from one thread. :class:`engine.LLMEngine` is one (it matches the
protocol as it is; :func:`local_engine` builds it from the worker's options).
A relay to an upstream OpenAI-compatible server (worker/upstream/) is the second
implementation; it has no tokenizer, so it also has the :class:`TakesBody`
capability: the worker hands it each request's body as is.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tokenrelay.core.wire.logprobs import Logprobs
from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.response_format import ResponseFormat
from tokenrelay.core.wire.stats import checked_models
from tokenrelay.core.wire.tools import Tool
from tokenrelay.core.wire.vocabulary import FinishReason
from tokenrelay.worker.prepare import Prepared

if TYPE_CHECKING:
    from tokenrelay.engine.config import EngineConfig


class StepOutput(Protocol):
    """What one request produced in one engine step.

    An output may also carry ``message: str``, why it failed, for a
    ``finish_reason`` of ``"error"`` (the ``done`` event's message).
    """

    request_id: str
    new_text: str  # the text delta (stop strings never appear)
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None  # an aborted request: CANCELLED; None: running
    prompt_tokens: int
    completion_tokens: int

    @property
    def new_logprobs(self) -> Sequence[Logprobs] | None:
        """One per new token id, when the request asked for logprobs (else ``None``)."""
        ...


class EngineClient(Protocol):
    """The step-level engine interface a worker drives (one thread, one call at a time).

    Except :meth:`encode` and :meth:`apply_chat_template`: the worker tokenizes
    long prompts on a second thread (worker/prepare.py), concurrently with the others
    (and compiles grammars there, :class:`MakesGuides`).
    """

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt string, as ``add_request`` would tokenize it. Thread-safe."""
        ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: tuple[Tool, ...] = ()
    ) -> list[int]:
        """Token ids of a chat offering ``tools``; ``ValueError`` naming the field for a bad
        message. Thread-safe."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        generated: Sequence[int] = (),
        guide: Any = None,
    ) -> int:
        """Queue a request; its prompt token count. ``ValueError`` for a bad one.

        ``generated``: tokens the request already produced (a stream continued from
        another worker's log): they are prefilled after the prompt, count as output
        (``max_tokens``, seeded sampling, penalties, stop strings, the grammar) and are
        not produced again. ``guide``: its grammar state, made on the preparer thread by
        :meth:`MakesGuides.guided_matcher` (``None``: none, or made here).
        """
        ...

    def abort(self, request_id: str) -> bool:
        """Stop a request at the next step and free what it holds; False if unknown."""
        ...

    def has_unfinished(self) -> bool:
        """Whether any request is queued or running."""
        ...

    def unstarted_requests(self) -> list[str]:
        """Ids of queued requests that have computed nothing yet (can be handed back)."""
        ...

    def step(self) -> Sequence[StepOutput]:
        """Run one step; what each request with news produced."""
        ...

    def stats(self) -> Mapping[str, Any]:
        """Numbers for the worker's published stats (core/wire/stats.py)."""
        ...

    @property
    def backend(self) -> str:
        """What kind of engine this is in the worker's stats: ``engine`` or ``upstream``."""
        ...

    def served_models(self) -> list[str] | None:
        """The models it serves now, when it learns them itself (a relay asks its upstream);
        ``None``: the worker announces ``--model-name`` and that stays."""
        ...

    def close(self) -> None:
        """Release what it holds (tensor-parallel ranks, a relay's connections); last call."""
        ...


class Starter(Protocol):
    """Where a request body goes before the engine runs it (worker/prepare.py's
    :class:`~worker.prepare.Preparer` tokenizes it); results come back from :meth:`take`."""

    def submit(self, stream_id: str, body: dict[str, Any]) -> None: ...

    def take(self) -> list[Prepared]: ...

    def forget(self, stream_id: str) -> None: ...

    def pending(self) -> int: ...

    def wait(self, timeout: float) -> bool: ...

    def close(self) -> None: ...


@runtime_checkable
class MakesGuides(Protocol):
    """An engine that makes a guided request's grammar state ahead of ``add_request``, on
    another thread: the preparer compiles it there (seconds for a large schema), never
    the step loop, and ``add_request`` takes it as ``guide``."""

    def guided_matcher(self, fmt: ResponseFormat) -> Any:
        """A new request's grammar state for ``fmt``; thread-safe; ``ValueError`` if refused."""
        ...


@runtime_checkable
class TakesBody(Protocol):
    """An engine that takes request bodies as they are (``messages`` or ``prompt``, and
    ``params``) instead of token ids: a relay to an upstream server (worker/upstream/).

    Its :meth:`starter` replaces the tokenizing :class:`~worker.prepare.Preparer`:
    a submitted body starts the request, and comes back from ``take()`` once the
    engine has it running (a ``Prepared`` without token ids: the worker then calls
    ``add_request(request_id, [], params)``, which returns the prompt tokens when
    known, else 0), or with the :class:`EngineRefused` that refuses the stream.
    ``forget()`` stops a request that has not been added.
    """

    def starter(self) -> Starter: ...


ENGINE_EXTRA = "pip install 'tokenrelay[engine]'"


def engine_missing(exc: ModuleNotFoundError) -> ValueError:
    """The one-line refusal of an installation without the engine's packages."""
    return ValueError(
        f"our engine needs the engine extra ({ENGINE_EXTRA}): {exc.name} is not installed "
        "(a relay worker, --upstream, needs neither)"
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings of ``tokenrelay worker``'s options, checked (torch is not imported).

    Raises ``ValueError`` with one clear line for a bad option, an unknown ``--model``, or
    an installation without the engine extra.
    """
    try:
        from tokenrelay.engine.config import EngineConfig
    except ModuleNotFoundError as exc:  # a base install: no torch, gguf, ...
        raise engine_missing(exc) from exc

    return EngineConfig(
        model=args.model,
        device=args.device,
        weights=getattr(args, "weights", "auto"),
        dtype=None if args.dtype == "auto" else args.dtype,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_while_decoding=getattr(args, "max_prefill_while_decoding", None),
    )


def local_engine(args: argparse.Namespace) -> EngineClient:
    """Our engine (:class:`engine.LLMEngine`) built from ``tokenrelay worker``'s options."""
    try:
        from tokenrelay.engine.llm_engine import LLMEngine
    except ModuleNotFoundError as exc:
        raise engine_missing(exc) from exc

    return LLMEngine(engine_config(args))


def served_models(args: argparse.Namespace) -> list[str]:
    """The name an engine worker announces for its model: ``--model-name``, else ``--model``
    as given; ``ValueError`` for a bad one."""
    name = getattr(args, "model_name", None) or args.model
    return checked_models([str(name)], "--model-name")
