"""CUDA graphs for decode steps: one graph per padded batch bucket, static input buffers.

At small batches a GPU decode step is mostly Python and kernel-launch overhead;
a graph captured once replays the whole step (every layer, the LM head) in one
launch. A graph fixes its tensors' addresses and shapes, so:

* a decode batch of ``n`` rows is padded to the smallest bucket ``b >= n`` of
  ``GRAPH_BUCKETS``; pad rows compute token 0 at position 0 in a spare block of
  the pool that no sequence owns (``pad_block``), and their logits are dropped;
* the step's metadata is built by the same :func:`build_metadata` as an eager
  step, on the host, and copied into static buffers sized for the largest
  bucket; each bucket's graph reads the leading ``b`` rows of them;
* only backends that read nothing but those tensors can be replayed
  (``AttentionBackend.graph_safe``); beyond the largest bucket, or with
  ``enforce_eager``, the runner steps eagerly.

With ``capture=False`` the same buffers and padding run the step function
directly instead of replaying a graph: that is how the CPU tests check
everything here but the capture itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenrelay.engine.attention.backend import AttentionBackend
from tokenrelay.engine.attention.metadata import AttentionMetadata, build_metadata

log = logging.getLogger("tokenrelay.engine")

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# (input_ids [b], metadata of b rows) -> fp32 logits [b, vocab]
StepFn = Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets worth capturing for batches of up to ``max_num_seqs`` rows."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    out = []
    for size in GRAPH_BUCKETS:
        out.append(size)
        if size >= max_num_seqs:
            break
    return tuple(out)


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``rows`` rows; ``None`` beyond the largest."""
    for size in buckets:
        if size >= rows:
            return size
    return None


@dataclass
class DecodeRows:
    """A decode batch: one token per sequence, at ``starts[i]``, in ``block_tables[i]``."""

    token_ids: list[int]
    starts: list[int]
    block_tables: list[list[int]]


def pad_rows(rows: DecodeRows, size: int, pad_block: int) -> DecodeRows:
    """``rows`` padded to ``size`` rows: token 0 at position 0 of block ``pad_block``."""
    extra = size - len(rows.token_ids)
    if extra < 0:
        raise ValueError(f"pad_rows: {len(rows.token_ids)} rows do not fit a bucket of {size}")
    return DecodeRows(
        rows.token_ids + [0] * extra,
        rows.starts + [0] * extra,
        rows.block_tables + [[pad_block]] * extra,
    )


class DecodeGraphs:
    """Decode steps of up to ``max(buckets)`` rows, replayed from per-bucket graphs."""

    def __init__(
        self,
        step: StepFn,
        *,
        buckets: tuple[int, ...],
        max_blocks: int,
        block_size: int,
        pad_block: int,
        device: torch.device,
        backend: AttentionBackend,
        capture: bool,
    ) -> None:
        if not backend.graph_safe:
            raise ValueError(f"attention backend {backend.name!r} cannot be replayed from a graph")
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.step = step
        self.buckets = buckets
        self.max_blocks = max_blocks  # block-table width every graph reads
        self.block_size = block_size
        self.pad_block = pad_block
        self.device = device
        self.backend = backend
        self.captured = capture
        rows = max(buckets)

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        i64, i32 = torch.int64, torch.int32
        self.input_ids = zeros(rows, dtype=i64)
        self.meta = AttentionMetadata(  # static buffers; each bucket views its first rows
            positions=zeros(rows, dtype=i64),
            slot_mapping=zeros(rows, dtype=i64),
            cu_seqlens_q=zeros(rows + 1, dtype=i32),
            cu_seqlens_k=zeros(rows + 1, dtype=i32),
            context_lens=zeros(rows, dtype=i32),
            block_tables=zeros(rows, max_blocks, dtype=i32),
            seq_of_token=zeros(rows, dtype=i64),
            row_lens=zeros(rows, dtype=i32),
            max_seqlen_q=1,
            max_seqlen_k=max_blocks * block_size,
            all_decode=True,
            block_size=block_size,
            backend=backend,
        )
        self._outputs: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture_all()

    @property
    def max_rows(self) -> int:
        return max(self.buckets)

    def fits(self, rows: int, widest_table: int) -> bool:
        """Whether a decode batch of ``rows`` rows can take a graph."""
        return rows <= self.max_rows and widest_table <= self.max_blocks

    def view(self, size: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """The static inputs of bucket ``size``: its leading rows of every buffer."""
        m = self.meta
        return self.input_ids[:size], AttentionMetadata(
            positions=m.positions[:size],
            slot_mapping=m.slot_mapping[:size],
            cu_seqlens_q=m.cu_seqlens_q[: size + 1],
            cu_seqlens_k=m.cu_seqlens_k[: size + 1],
            context_lens=m.context_lens[:size],
            block_tables=m.block_tables[:size],
            seq_of_token=m.seq_of_token[:size],
            row_lens=m.row_lens[:size],
            max_seqlen_q=1,
            max_seqlen_k=m.max_seqlen_k,
            all_decode=True,
            block_size=m.block_size,
            backend=m.backend,
        )

    def load(self, rows: DecodeRows) -> int:
        """Pad ``rows`` to their bucket and copy them into the static buffers; the bucket."""
        size = bucket_for(len(rows.token_ids), self.buckets)
        if size is None:
            raise ValueError(f"{len(rows.token_ids)} rows exceed the largest graph bucket")
        padded = pad_rows(rows, size, self.pad_block)
        host = build_metadata(
            [1] * size,
            padded.starts,
            padded.block_tables,
            block_size=self.block_size,
            device=torch.device("cpu"),
            backend=self.backend,
            plan=False,
        )  # the eager path's own builder
        width = host.block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"block tables of {width} blocks exceed the graphs' {self.max_blocks}")
        m = self.meta
        self.input_ids[:size].copy_(torch.tensor(padded.token_ids), non_blocking=True)
        for name in ("positions", "slot_mapping", "context_lens", "seq_of_token", "row_lens"):
            getattr(m, name)[:size].copy_(getattr(host, name), non_blocking=True)
        m.cu_seqlens_q[: size + 1].copy_(host.cu_seqlens_q, non_blocking=True)
        m.cu_seqlens_k[: size + 1].copy_(host.cu_seqlens_k, non_blocking=True)
        m.block_tables[:size, :width].copy_(host.block_tables, non_blocking=True)
        return size

    def run(self, rows: DecodeRows) -> torch.Tensor:
        """fp32 logits ``[n, vocab]`` of the ``n`` rows (replayed, or stepped on the buffers)."""
        size = self.load(rows)
        graph = self._graphs.get(size)
        if graph is None:
            ids, meta = self.view(size)
            return self.step(ids, meta)[: len(rows.token_ids)]
        graph.replay()
        return self._outputs[size][: len(rows.token_ids)]

    def _capture_all(self) -> None:
        """Capture every bucket, largest first, in one memory pool."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.buckets, reverse=True):
            self.load(pad_rows(DecodeRows([], [], []), size, self.pad_block))  # all pad rows
            ids, meta = self.view(size)
            self.step(ids, meta)  # warm-up: kernels compiled and autotuned outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self.step(ids, meta)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)
        log.info(
            "CUDA graphs captured",
            extra={
                "buckets": list(self.buckets),
                "seconds": round(time.perf_counter() - started, 2),
            },
        )
