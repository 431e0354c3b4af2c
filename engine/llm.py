"""Offline batch generation: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from tokenrelay.core.wire.logprobs import Logprobs
from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.engine.config import EngineConfig
from tokenrelay.engine.llm_engine import LLMEngine


@dataclass
class CompletionOutput:
    """One finished completion."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    request_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    # when the params asked (``logprobs``): one per generated token, EOS that ended it excepted
    logprobs: list[Logprobs] | None = None


class LLM:
    """Generate completions for many prompts at once with continuous batching.

    ``model`` is ``"default"``, a local Hugging Face folder or a ``.gguf`` file;
    other keyword arguments go to :class:`EngineConfig` (``num_blocks``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``dtype``, ``tensor_parallel_size``
    ...). With ``tensor_parallel_size > 1`` call :meth:`close` when done (it stops the
    other ranks' processes; they end with this process at the latest).
    """

    _ids = itertools.count()

    def __init__(self, model: str = "default", device: str = "auto", **engine_kwargs: Any):
        self.engine = LLMEngine(EngineConfig(model=model, device=device, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks, if any (idempotent)."""
        self.engine.close()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (no second copy of the weights)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm.tokenizer = engine.tokenizer
        return llm

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """Complete every prompt; outputs come back in the prompts' order.

        ``prompts`` is one string, a list of strings, or a list of token-id
        lists; ``params`` is one :class:`SamplingParams` for all, or one per
        prompt. A bad prompt raises ``ValueError`` before anything runs.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        prompt_list = list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            param_list = [params] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(
                    f"params: got {len(param_list)} SamplingParams for {len(prompt_list)} prompts"
                )
        engine = self.engine
        batch = next(self._ids)
        ids = [f"llm-{batch}-{i}" for i in range(len(prompt_list))]
        results = {rid: CompletionOutput("", [], None, 0, rid) for rid in ids}
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        try:
            for rid, prompt, p in zip(ids, prompt_list, param_list, strict=True):
                prompt_ids: str | list[int] = (
                    prompt if isinstance(prompt, str) else cast(list[int], list(prompt))
                )
                results[rid].prompt_tokens = engine.add_request(rid, prompt_ids, p)
                seq = engine.scheduler.get(rid)
                if seq is not None:
                    results[rid].prompt_token_ids = list(seq.prompt_token_ids)
        except Exception:
            for rid in ids:  # leave the engine as it was
                engine.abort(rid)
            while any(engine.scheduler.get(rid) is not None for rid in ids):
                engine.step()
            raise
        bar = _progress(len(ids)) if use_tqdm else None
        pending = set(ids)
        try:
            while pending:
                for out in engine.step():
                    if out.request_id not in pending:
                        continue
                    res = results[out.request_id]
                    texts[out.request_id].append(out.new_text)
                    res.token_ids.extend(out.new_token_ids)
                    if out.new_logprobs is not None:
                        res.logprobs = res.logprobs if res.logprobs is not None else []
                        res.logprobs.extend(out.new_logprobs)
                    if out.finished:
                        res.finish_reason = out.finish_reason
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in pending:  # interrupted: the engine drops them at its next step
                engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        for rid in ids:
            results[rid].text = "".join(texts[rid])
        return [results[rid] for rid in ids]


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req")
