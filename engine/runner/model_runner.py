"""Runs the model over the paged KV cache for one engine step and samples.

The scheduler hands :meth:`ModelRunner.execute` a list of :class:`BatchItem`; the runner
flattens them into one varlen batch (token ids, positions, slot mapping, block tables,
cu_seqlens), runs the decoder once, computes logits only for the last token of items
that sample, and returns one token (or ``None``) per item. Decode steps on a CUDA device
with a graph-safe attention backend replay CUDA graphs (engine/runner/graphs.py) unless
``enforce_eager``.

Under tensor parallelism (``group``, engine/parallel/) every rank has a runner with its
shard of the weights and of the KV pool; rank 0's :meth:`execute` hands the step's
:class:`StepInput` to the others, which run :meth:`forward` on it (engine/parallel/rank.py),
and only rank 0 samples. Such a runner is always eager.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenrelay.core.runtime import env_switch
from tokenrelay.engine.attention import registry
from tokenrelay.engine.attention.metadata import AttentionMetadata, build_metadata
from tokenrelay.engine.kernels import cpu_attention, decoder, quant
from tokenrelay.engine.kernels.build import prebuild
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.weights import load_model
from tokenrelay.engine.parallel.layout import local_config
from tokenrelay.engine.runner.devices import (
    DTYPES,
    configure_threads,
    kv_dtype_name,
    resolve_device,
    resolve_dtype,
)
from tokenrelay.engine.runner.graphs import DecodeGraphs, DecodeRows, graph_buckets
from tokenrelay.engine.runner.kv_cache import KVCache, plan_num_blocks
from tokenrelay.engine.runner.logprobs import SampleLogprobs
from tokenrelay.engine.runner.sampler import Sampler
from tokenrelay.engine.runner.step import StepInput
from tokenrelay.engine.runner.twins import plan_twins
from tokenrelay.engine.scheduling.batch import BatchItem

if TYPE_CHECKING:
    from tokenrelay.engine.guided.matcher import GuidedMatcher
    from tokenrelay.engine.parallel.group import Group

log = logging.getLogger("tokenrelay.engine")


class ModelRunner:
    """Owns the model, the KV pool and the sampler of one engine worker (or one rank's
    shard of them, with ``group``)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str | torch.device = "auto",
        dtype: torch.dtype | str | None = None,
        block_size: int | None = None,
        kv_cache_memory_gib: float | None = None,
        kv_cache_dtype: torch.dtype | str | None = "auto",
        num_blocks: int | None = None,
        num_threads: int | None = None,
        seed: int | None = None,
        gguf: Path | None = None,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        max_num_seqs: int = 64,
        group: Group | None = None,
        max_model_len: int | None = None,
    ) -> None:
        if block_size is not None and (
            isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0
        ):
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if num_blocks is not None and (
            isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0
        ):
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if kv_cache_memory_gib is not None and not kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {kv_cache_memory_gib!r}")
        self.path = _resolve_path(model_path)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        dtype_name = str(self.dtype).replace("torch.", "")
        self.attention_backend = registry.choose(attention_backend, self.device.type, dtype_name)
        kv_name = kv_dtype_name(kv_cache_dtype)  # a pool the backend cannot read fails here:
        registry.kv_cache_dtype(kv_name, self.attention_backend, dtype_name)  # before loading
        self.block_size = block_size = registry.block_size_for(self.attention_backend, block_size)
        fuse = gguf is not None and self.attention_backend == "cpu"
        self.group = group
        if group is not None and gguf is not None:
            raise ValueError("tensor parallelism runs dense weights (fp32 or bf16), not native")
        if self.device.type == "cpu":
            if group is not None and num_threads is None and "OMP_NUM_THREADS" not in os.environ:
                num_threads = max(1, len(os.sched_getaffinity(0)) // group.size)  # share the CPUs
            configure_threads(num_threads)
            prebuild(_cpu_kernels(gguf is not None, self.attention_backend))  # beside the load
        started = time.perf_counter()
        self.model_config = ModelConfig.from_pretrained(self.path)
        if gguf is not None:  # quantized weights as they are (engine/models/gguf_weights.py)
            if self.device.type != "cpu" or self.dtype != torch.float32:
                raise ValueError("weights=native runs on the CPU in float32")
            from tokenrelay.engine.models.gguf_weights import load_gguf_model

            self.model = load_gguf_model(gguf, self.model_config)
            if fuse:  # every layer in one C call (engine/kernels/decoder.py)
                self.model.fuse()
        else:
            self.model = load_model(self.path, self.model_config, self.device, self.dtype, group)
        if max_model_len is not None:  # the context served picks longrope's factors (rope.py)
            self.model.init_rope(self.device, max_model_len)
        self.weights = "native" if gguf is not None else str(self.dtype).replace("torch.", "")
        self.load_seconds = time.perf_counter() - started
        self.max_model_len = self.model_config.max_position_embeddings
        self.eos_token_ids: set[int] = set(self.model_config.eos_token_ids)
        size = 1 if group is None else group.size
        shard = local_config(self.model_config, size)  # this rank's KV heads
        fused = self.model.fused is not None  # auto: float16 under the fused decoder
        kv_name = registry.kv_cache_dtype(kv_name, self.attention_backend, dtype_name, fused)
        self.kv_dtype = DTYPES[kv_name]
        self.num_blocks = plan_num_blocks(
            shard,
            block_size=block_size,
            dtype=self.kv_dtype,
            device=self.device,
            kv_cache_memory_gib=kv_cache_memory_gib,
            num_blocks=num_blocks,
        )
        if group is not None:  # the same block ids on every rank: the smallest pool
            self.num_blocks = group.min_int(self.num_blocks)
        # one spare block past the pool, owned by no sequence: the pad rows of graph buckets
        self.pad_block = self.num_blocks
        self.kv_cache = KVCache(shard, self.num_blocks + 1, block_size, self.kv_dtype, self.device)
        self.attention = registry.create(self.attention_backend, self.device, self.dtype)
        self.sampler = Sampler(seed)
        # per item of the latest execute(): its token's logprobs if asked (empty: none asked)
        self.last_logprobs: list[SampleLogprobs | None] = []
        self.graphs: DecodeGraphs | None = None
        eager = enforce_eager or group is not None
        if self.device.type == "cuda" and self.attention.graph_safe and not eager:
            self.graphs = self.decode_graphs(graph_buckets(max_num_seqs), capture=True)
        self.graph_buckets = self.graphs.buckets if self.graphs is not None else ()
        log.info(
            "model runner ready",
            extra={
                "model": str(self.path),
                "device": str(self.device),
                "dtype": str(self.dtype),
                "kv_cache_dtype": kv_name,
                "weights": self.weights,
                "load_s": round(self.load_seconds, 3),
                "num_blocks": self.num_blocks,
                "attention": self.attention_backend,
                "block_size": block_size,
                "cuda_graphs": list(self.graph_buckets),
                "threads": torch.get_num_threads(),
                "decoder": "fused" if self.model.fused is not None else "op-by-op",
                "tensor_parallel": f"{group.rank}/{group.size}" if group is not None else None,
            },
        )

    def decode_graphs(self, buckets: tuple[int, ...], *, capture: bool) -> DecodeGraphs:
        """Graphs (or, ``capture=False``, their padded static buffers) for decode steps."""
        return DecodeGraphs(
            self._graph_step,
            buckets=buckets,
            max_blocks=-(-self.max_model_len // self.block_size),
            block_size=self.block_size,
            pad_block=self.pad_block,
            device=self.device,
            backend=self.attention,
            capture=capture,
        )

    def _graph_step(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One decode step on static inputs: fp32 logits ``[b, vocab]`` of every row."""
        with torch.inference_mode():
            hidden = self.model(input_ids, meta.positions, meta, self.kv_cache)
            return self.model.compute_logits(hidden)

    def execute(
        self, items: list[BatchItem], matchers: Mapping[str, GuidedMatcher] | None = None
    ) -> list[int | None]:
        """Run one step; returns the sampled token per item (``None`` where ``sample`` is False).

        ``matchers``: request id -> grammar of the guided requests (their tokens are
        masked to what the grammar allows; the caller advances the matchers). The sampled
        tokens' logprobs are in :attr:`last_logprobs` (see there).
        """
        self.last_logprobs = []
        if not items:
            return []
        self._validate(items)
        graphs = self.graphs
        if (
            graphs is not None
            and all(it.sample and len(it.token_ids) == 1 for it in items)
            and graphs.fits(len(items), max(len(it.block_table) for it in items))
        ):
            decode = DecodeRows(
                [it.token_ids[0] for it in items],
                [it.start_pos for it in items],
                [it.block_table for it in items],
            )
            return self._sample(items, list(range(len(items))), graphs.run(decode), matchers)
        step = StepInput.of(items)
        peers = self.group.peers if self.group is not None else None
        if peers is None:
            twins = plan_twins(step, self.block_size)  # identical chunks computed once
            logits = self.forward(twins.reduced if twins is not None else step)
            if twins is not None:
                twins.copy_kv(self.kv_cache)
                logits = None if logits is None else twins.expand(logits)
        else:
            try:
                peers.publish(step)
                logits = self.forward(step)
            except RuntimeError as exc:  # a collective failed: which rank is gone?
                raise peers.failure(exc) from exc
        if logits is None:
            return [None] * len(items)
        return self._sample(items, step.sampling, logits, matchers)

    def forward(self, step: StepInput) -> torch.Tensor | None:
        """Run the model over ``step``: fp32 logits ``[N, V]`` of its sampling items' last
        tokens (``None`` when none samples). Every tensor-parallel rank runs it."""
        meta = build_metadata(
            [len(ids) for ids in step.token_ids],
            step.starts,
            step.block_tables,
            block_size=self.block_size,
            device=self.device,
            backend=self.attention,
            plan=self.model.fused is None,
        )
        flat_ids = list(chain.from_iterable(step.token_ids))
        input_ids = torch.from_numpy(np.array(flat_ids, dtype=np.int64)).to(
            self.device, non_blocking=True
        )
        sampling, num_items = step.sampling, len(step.token_ids)
        every_row = len(sampling) == num_items == len(flat_ids)  # decode: each row samples
        with torch.inference_mode():
            vocab = self.model.fused.vocab if self.model.fused is not None else None
            if every_row and vocab is not None:  # the LM head inside the fused step
                logits = torch.empty(len(flat_ids), vocab)
                self.model(input_ids, meta.positions, meta, self.kv_cache, logits)
                return self.model.finish_logits(logits)
            hidden = self.model(input_ids, meta.positions, meta, self.kv_cache)  # [T, E]
            if not sampling:
                return None
            if every_row:
                last_hidden = hidden  # one token per item, each sampled: every row
            else:
                last = meta.cu_seqlens_q[1:].to(torch.int64) - 1  # [B] last row of each
                rows = last if len(sampling) == num_items else last[sampling]
                last_hidden = hidden.index_select(0, rows)
            return self.model.compute_logits(last_hidden)  # [N, V] fp32

    def check(self) -> None:
        """Raise ``TensorParallelError`` when a tensor-parallel rank is gone (else nothing)."""
        if self.group is not None and self.group.peers is not None:
            self.group.peers.check()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and leave the group (idempotent)."""
        if self.group is not None:
            if self.group.peers is not None:
                self.group.peers.close()
            self.group.close()

    def _sample(
        self,
        items: list[BatchItem],
        sampling: list[int],
        logits: torch.Tensor,
        matchers: Mapping[str, GuidedMatcher] | None = None,
    ) -> list[int | None]:
        """One token per row of ``logits`` (fp32 ``[N, V]``) for ``items[sampling[i]]``.

        The logprobs of the items whose params ask go to :attr:`last_logprobs`.
        """
        with torch.inference_mode():
            result = self.sampler.sample(
                logits,
                [items[i].params for i in sampling],
                [items[i].output_index for i in sampling],
                [items[i].past_token_ids for i in sampling],
                [matchers.get(items[i].request_id) for i in sampling] if matchers else None,
            )
            tokens = result.tokens.tolist()
        out: list[int | None] = [None] * len(items)
        for i, tok in zip(sampling, tokens, strict=True):
            out[i] = tok
        if result.logprobs is not None:
            self.last_logprobs = [None] * len(items)
            for i, lp in zip(sampling, result.logprobs, strict=True):
                self.last_logprobs[i] = lp
        return out

    def _validate(self, items: list[BatchItem]) -> None:
        vocab = self.model_config.vocab_size
        for it in items:
            n = len(it.token_ids)
            if n == 0:
                raise ValueError(f"token_ids: request {it.request_id!r} has no tokens to compute")
            if it.start_pos < 0:
                raise ValueError(f"start_pos: must be >= 0, got {it.start_pos}")
            if it.start_pos + n > self.max_model_len:
                raise ValueError(
                    f"token_ids: request {it.request_id!r} reaches position {it.start_pos + n}, "
                    f"beyond max_model_len {self.max_model_len}"
                )
            if min(it.token_ids) < 0 or max(it.token_ids) >= vocab:
                raise ValueError(
                    f"token_ids: request {it.request_id!r} has ids outside [0, {vocab})"
                )
            if it.block_table and (
                min(it.block_table) < 0 or max(it.block_table) >= self.num_blocks
            ):
                raise ValueError(
                    f"block_table: request {it.request_id!r} names a block outside "
                    f"[0, {self.num_blocks})"
                )


def _cpu_kernels(native: bool, backend: str) -> list[Path]:
    """The C kernels (engine/kernels/csrc) a CPU runner will load, for ``prebuild``."""
    sources = [cpu_attention.SOURCE] if backend == "cpu" else []
    if native:
        sources.append(quant.SOURCE)
        if backend == "cpu" and env_switch(decoder.FUSED_SWITCH):
            sources.append(decoder.SOURCE)
    return sources


def _resolve_path(model_path: str | Path) -> Path:
    path = Path(model_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {path} has no config.json")
        return path
    from tokenrelay.engine.models.store import resolve_model

    return resolve_model(str(model_path))
