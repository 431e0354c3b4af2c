"""The step-level engine: requests in, per-step text deltas out.

One :class:`LLMEngine` owns the tokenizer, the model runner (weights, KV pool,
sampler), the block manager and the scheduler. A caller (the gateway's worker,
or :class:`engine.LLM`) adds requests at any time and calls :meth:`step` in a
loop; each step returns a :class:`RequestOutput` for every request that
produced text or tokens, or finished, in that step.

Threading: :meth:`abort`, :meth:`encode`, :meth:`apply_chat_template` and
:meth:`guided_matcher` may be called from other threads, the rest from :meth:`step`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenrelay.core.wire.logprobs import Logprobs, TokenLogprob
from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.response_format import ResponseFormat
from tokenrelay.core.wire.tool_formats import detect_format
from tokenrelay.core.wire.tools import Tool
from tokenrelay.core.wire.vocabulary import FinishReason
from tokenrelay.engine.config import EngineConfig
from tokenrelay.engine.guided.compiler import EngineGrammars
from tokenrelay.engine.scheduling.block_manager import BlockManager
from tokenrelay.engine.scheduling.scheduler import Scheduler
from tokenrelay.engine.scheduling.sequence import Sequence
from tokenrelay.engine.text.chat import marker_tokens, render_chat

if TYPE_CHECKING:
    from tokenrelay.engine.guided.matcher import GuidedMatcher
    from tokenrelay.engine.runner.logprobs import SampleLogprobs

log = logging.getLogger("tokenrelay.engine")


@dataclass
class RequestOutput:
    """What one request produced in one step.

    ``new_text`` is the text delta (a stop string and anything after it never
    appears); ``new_token_ids`` may hold a token that adds no text (EOS, a
    partial UTF-8 character, a held-back possible stop-string prefix).
    ``new_logprobs`` (when the request's ``logprobs`` is set) has one entry per
    id of ``new_token_ids``.
    """

    request_id: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None  # STOP, LENGTH or CANCELLED (aborted); None: running
    prompt_tokens: int
    completion_tokens: int
    new_logprobs: list[Logprobs] | None = None


class LLMEngine:
    """Continuous batching over a paged KV cache, one step at a time."""

    backend = "engine"  # what a worker's stats call it (the worker's EngineClient)

    def __init__(self, config: EngineConfig) -> None:
        from tokenrelay.engine.attention.registry import choose
        from tokenrelay.engine.models.store import resolve_gguf, resolve_model
        from tokenrelay.engine.runner.devices import resolve_device, resolve_dtype
        from tokenrelay.engine.runner.model_runner import ModelRunner
        from tokenrelay.engine.text.detokenizer import IncrementalDetokenizer
        from tokenrelay.engine.text.token_text import TokenTexts
        from tokenrelay.engine.text.tokenizer import load_tokenizer

        self.config = config
        gguf = None
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        # checked before anything loads: a backend that cannot run here fails fast
        backend = choose(config.attention_backend, device.type, str(dtype).split(".")[-1])
        # native: the GGUF's blocks as they are, only its config and tokenizer prepared
        if config.weights_for(device.type, backend) == "native":
            self.model_path, gguf = resolve_gguf(config.model)
        else:
            self.model_path = resolve_model(config.model)  # converts a GGUF file once
        self._detokenizer_cls = IncrementalDetokenizer
        self.tokenizer: Any = load_tokenizer(self.model_path)
        self.token_texts = TokenTexts(self.tokenizer)  # a token's own text, for logprobs
        runner_kwargs: dict[str, Any] = dict(
            dtype=dtype,
            block_size=config.block_size,
            kv_cache_memory_gib=config.kv_cache_memory,
            num_blocks=config.num_blocks,
            attention_backend=backend,
            enforce_eager=config.enforce_eager,
            max_num_seqs=config.max_num_seqs,
            kv_cache_dtype=config.kv_cache_dtype,
            max_model_len=config.max_model_len,
        )
        if config.tensor_parallel_size > 1:  # ranks 1..N-1 in processes of their own
            from tokenrelay.engine.parallel.workers import parallel_runner

            self.runner = parallel_runner(
                config.tensor_parallel_size, device, model_path=self.model_path, **runner_kwargs
            )
        else:
            self.runner = ModelRunner(self.model_path, gguf=gguf, device=device, **runner_kwargs)
        try:
            self._init_state(config)
        except BaseException:
            self.runner.close()
            raise

    def _init_state(self, config: EngineConfig) -> None:
        """Limits, block manager and scheduler, once the runner is up."""
        model_len = self.runner.max_model_len
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ValueError(
                f"max_model_len: {config.max_model_len} exceeds the model's context {model_len}"
            )
        self.block_size = self.runner.block_size
        pool_len = self.runner.num_blocks * self.block_size
        # Capped at the pool so the oldest sequence alone always fits (no preemption deadlock).
        self.max_model_len = min(config.max_model_len or model_len, pool_len)
        if self.max_model_len < 2:
            raise ValueError(f"num_blocks: a pool of {pool_len} token slots is too small")
        self.vocab_size = self.runner.model_config.vocab_size
        self.eos_token_ids: set[int] = set(self.runner.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(self.tokenizer.eos_token_id))
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.block_size, config.enable_prefix_caching
        )
        self.max_num_batched_tokens = config.default_batched_tokens(self.runner.device.type)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, self.max_num_batched_tokens,
            config.default_prefill_while_decoding(self.runner.device.type),
        )  # fmt: skip
        self._detok: dict[str, Any] = {}
        self._grammars = EngineGrammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.tool_format = detect_format(getattr(self.tokenizer, "chat_template", None))
        self._kept = marker_tokens(self.tokenizer, self.tool_format)
        self._matchers: dict[str, GuidedMatcher] = {}  # request id -> its grammar's state
        self._arrivals = 0
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.step_seconds = 0.0

    # ---------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        generated: Iterable[int] = (),
        guide: GuidedMatcher | None = None,
    ) -> int:
        """Queue a request; returns its prompt token count.

        ``generated``: tokens it already produced elsewhere (its worker died), prefilled
        after the prompt and counted as output (max_tokens, seeded draws, penalties, stop
        strings and the grammar go on from them). ``guide``: its grammar state, made ahead
        by :meth:`guided_matcher` (else it is made here, compiling on this thread).

        Raises ``ValueError`` naming the field for an empty or too long prompt,
        token ids outside the vocabulary, a duplicate ``request_id`` or bad
        params; nothing else is disturbed.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if self.scheduler.get(request_id) is not None:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        for name, ids in (("logit_bias", params.logit_bias),
                          ("stop_token_ids", params.stop_token_ids)):  # fmt: skip
            if any(t >= self.vocab_size for t in ids):
                raise ValueError(f"{name}: token ids must be in [0, {self.vocab_size})")
        token_ids = self._prompt_ids(prompt)
        if len(token_ids) + 1 > self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leave no room to generate within the "
                f"context of {self.max_model_len} tokens"
            )
        output = list(generated)
        if not all(type(t) is int and 0 <= t < self.vocab_size for t in output):
            raise ValueError(f"generated: token ids must be in [0, {self.vocab_size})")
        if output and (len(output) >= params.max_tokens or
                       len(token_ids) + len(output) >= self.max_model_len):  # fmt: skip
            raise ValueError(f"generated: {len(output)} tokens leave no room to generate")
        matcher = self._grammars.for_request(params, guide, self.tool_format)
        kept = self._kept if params.offered_tools else None  # the parser reads the markers
        detok = self._detokenizer_cls(self.tokenizer, list(params.stop), kept)
        for token in output:  # the state they left: held-back text, the grammar's position
            detok.add(token)
            if matcher is not None and not matcher.accept(token):
                raise ValueError(f"generated: token {token} does not fit the response_format")
        seq = Sequence(request_id, token_ids, params, self._arrivals)
        seq.token_ids.extend(output)
        self._arrivals += 1
        self.scheduler.add(seq)
        self._detok[request_id] = detok
        if matcher is not None:
            self._matchers[request_id] = matcher
        return len(token_ids)

    def guided_matcher(self, fmt: ResponseFormat) -> GuidedMatcher:
        """A new request's grammar state for ``fmt`` (``params.guided``), for
        :meth:`add_request`'s ``guide``: compiled once per distinct grammar, then copied.
        Thread-safe: a worker calls it beside the step loop. ``ValueError`` if refused."""
        return self._grammars.compiler.matcher(fmt)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = self.encode(prompt)
        elif isinstance(prompt, list | tuple):
            ids = list(prompt)
            for tok in ids:
                if isinstance(tok, bool) or not isinstance(tok, int):
                    raise ValueError(f"prompt: token ids must be integers, got {tok!r}")
                if not 0 <= tok < self.vocab_size:
                    raise ValueError(
                        f"prompt: token id {tok} is outside the vocabulary [0, {self.vocab_size})"
                    )
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {prompt!r}")
        if not ids:
            raise ValueError("prompt must not be empty")
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt string, as :meth:`add_request` tokenizes it.

        Thread-safe, and the tokenizer releases the GIL while it encodes: a
        worker calls it from another thread than the one that steps the engine.
        """
        return list(self.tokenizer(text)["input_ids"])

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: tuple[Tool, ...] = ()
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the model's chat template (engine/text/chat.py),
        ``tools`` offered, ending with the assistant's generation prompt. Thread-safe (see
        :meth:`encode`)."""
        text = render_chat(self.tokenizer, messages, tools)
        # The template already holds any BOS; don't let the tokenizer add another.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def abort(self, request_id: str) -> bool:
        """Stop ``request_id`` at the next step (its blocks are freed then).

        Returns False for an unknown or already finished request. Thread-safe.
        """
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def unstarted_requests(self) -> list[str]:
        """Ids of requests that have not produced a token yet (waiting or prefilling).

        Such a request can be aborted here and run from scratch elsewhere with
        no visible difference (a draining worker hands them back).
        """
        return [s.request_id for s in self.scheduler.live_sequences() if s.num_output_tokens == 0]

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one engine step: aborts, one batched forward pass, sampling, detokenizing.

        Under tensor parallelism a rank that died (or a failed collective) raises
        ``TensorParallelError`` here, at every step from then on.
        """
        self.runner.check()
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        outputs = [
            RequestOutput(
                seq.request_id,
                "",
                [],
                True,
                FinishReason.CANCELLED,
                seq.num_prompt_tokens,
                seq.num_output_tokens,
            )
            for seq in plan.aborted
        ]
        for seq in plan.aborted:
            self._detok.pop(seq.request_id, None)
            self._matchers.pop(seq.request_id, None)
        if plan.items:
            sampled = self.runner.execute(plan.items, self._matchers or None)
            logprobs = {  # (none: no item asked)
                item.request_id: lp
                for item, lp in zip(plan.items, self.runner.last_logprobs, strict=False)
                if lp is not None
            }
            for seq, token in self.scheduler.update(plan, sampled):
                output = self._on_token(seq, token)
                lp = logprobs.get(seq.request_id)
                # an EOS that ends the text is no part of it: OpenAI shows no logprob for it
                if lp is not None and (token not in self.eos_token_ids or seq.params.ignore_eos):
                    output.new_logprobs = [self._logprobs(lp)]
                outputs.append(output)
            self.num_steps += 1
        self.step_seconds += time.perf_counter() - started
        return outputs

    def _logprobs(self, lp: SampleLogprobs) -> Logprobs:
        """A sampled token's logprobs with each token's own text and bytes."""

        def one(token_id: int, logprob: float) -> TokenLogprob:
            text, raw = self.token_texts(token_id)
            return TokenLogprob(text, logprob, raw)

        top = tuple(one(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True))
        return Logprobs(one(lp.token_id, lp.logprob), top)

    def _on_token(self, seq: Sequence, token: int) -> RequestOutput:
        params = seq.params
        detok = self._detok[seq.request_id]
        self.num_generated_tokens += 1
        reason: FinishReason | None = None
        if token in self.eos_token_ids and not params.ignore_eos:
            text, reason = detok.flush(), FinishReason.STOP  # EOS ends the text, never part of it
        elif token in params.stop_token_ids:  # vLLM: its text stays (none for a special one)
            text = detok.add(token)
            text, reason = text + detok.flush(), FinishReason.STOP
        else:
            text = detok.add(token)
            matcher = self._matchers.get(seq.request_id)
            if detok.stopped:
                reason = FinishReason.STOP
            elif matcher is not None and self._complete(matcher, token):
                text, reason = (
                    text + detok.flush(),
                    FinishReason.STOP,
                )  # no EOS step once the JSON is whole
            elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                text += detok.flush()
                reason = FinishReason.LENGTH
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self._detok[seq.request_id]
            self._matchers.pop(seq.request_id, None)
        return RequestOutput(
            seq.request_id,
            text,
            [token],
            reason is not None,
            reason,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
        )

    @staticmethod
    def _complete(matcher: GuidedMatcher, token: int) -> bool:
        """Advance ``matcher`` by ``token``; True when nothing but EOS may follow."""
        if not matcher.accept(token):  # the mask prevents this; end rather than go on
            log.warning("guided decoding: token %d refused: %s", token, matcher.error)
        return matcher.stopped

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (idempotent; nothing to do otherwise)."""
        self.runner.close()

    def served_models(self) -> list[str] | None:
        """None: the model is the one it was built with (the worker names it)."""
        return None

    def reset_prefix_cache(self) -> int:
        """Forget the cached-free prefix blocks (for benchmarks and tests)."""
        return self.block_manager.reset_prefix_cache()

    # ------------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """Pool, queue and work counters (``blocks_free`` includes cached-free blocks)."""
        sched = self.scheduler
        return {
            **self.block_manager.stats(),
            "running": sched.num_running,
            "waiting": sched.num_waiting,
            "prompt_tokens_computed": sched.prompt_tokens_computed,
            "decode_tokens_computed": sched.decode_tokens_computed,
            "generated_tokens": self.num_generated_tokens,
            "preemptions": sched.num_preemptions,
            "num_steps": self.num_steps,
            "step_seconds": round(self.step_seconds, 6),
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": sched.max_num_seqs,
        }
