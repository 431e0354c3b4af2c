"""Decode steps at padded graph buckets: buckets, padding, static buffers, eager fallback.

A CUDA graph itself needs a GPU; everything around it (the buckets, the pad rows in
their spare block, the static buffers the step reads, the eager path beyond the largest
bucket) runs here with ``capture=False``, through the Triton kernels under Triton's CPU
interpreter, on a tiny random model: the tokens must be those of an eager runner.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from tests.engine.runner.test_model_runner import generate
from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.engine.runner.graphs import (
    GRAPH_BUCKETS,
    DecodeRows,
    bucket_for,
    graph_buckets,
    pad_rows,
)
from tokenrelay.engine.runner.model_runner import ModelRunner

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


def test_buckets_cover_the_batch_limit() -> None:
    assert GRAPH_BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert graph_buckets(1000) == GRAPH_BUCKETS
    assert graph_buckets(1) == (1,)
    with pytest.raises(ValueError):
        graph_buckets(0)
    assert [bucket_for(n, (1, 2, 4)) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]


def test_pad_rows_point_at_the_spare_block() -> None:
    rows = DecodeRows([5, 6, 7], [10, 0, 33], [[1, 2], [3], [4, 5, 6]])
    padded = pad_rows(rows, 8, pad_block=99)
    assert padded.token_ids == [5, 6, 7] + [0] * 5
    assert padded.starts == [10, 0, 33] + [0] * 5
    assert padded.block_tables == [[1, 2], [3], [4, 5, 6]] + [[99]] * 5
    assert rows.token_ids == [5, 6, 7]  # the caller's rows are left alone
    with pytest.raises(ValueError, match="do not fit"):
        pad_rows(rows, 2, pad_block=99)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    return path


def runner(path: Path, backend: str) -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype="float32", num_blocks=48, block_size=8,
                       attention_backend=backend, max_num_seqs=4)  # fmt: skip


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


@needs_triton
@pytest.mark.parametrize("num_prompts", [1, 3, 5])
def test_padded_bucket_steps_give_the_eager_tokens(tiny_model: Path, num_prompts: int) -> None:
    """1 row (bucket 1), 3 rows padded to 4, 5 rows beyond the largest bucket (eager)."""
    prompts = [PROMPTS[i % 3][i // 3 :] for i in range(num_prompts)]
    params = [SamplingParams(temperature=0, max_tokens=8)] * num_prompts
    reference = generate(runner(tiny_model, "torch"), prompts, params, 8)

    graphed = runner(tiny_model, "triton")
    assert graphed.graphs is None  # no CUDA here: eager unless given graphs
    graphs = graphed.graphs = graphed.decode_graphs((1, 2, 4), capture=False)
    ids_buffer = graphs.input_ids.data_ptr()
    loads: list[int] = []
    load = graphs.load
    graphs.load = lambda rows: loads.append(len(rows.token_ids)) or load(rows)  # type: ignore[method-assign]
    assert generate(graphed, prompts, params, 8) == reference
    if num_prompts <= 4:
        assert loads == [num_prompts] * 7  # every decode step went through the buffers
        assert graphs.input_ids.data_ptr() == ids_buffer  # static: never reallocated
        if num_prompts == 3:  # the pad row computed in the spare block, nowhere else
            assert graphed.kv_cache.k[0][graphed.pad_block].abs().sum() > 0
    else:
        assert loads == []  # beyond bucket 4: the eager path


@needs_triton
def test_graphs_refuse_what_they_cannot_replay(tiny_model: Path) -> None:
    eager = runner(tiny_model, "torch")
    with pytest.raises(ValueError, match="cannot be replayed"):
        eager.decode_graphs((1, 2), capture=False)
    triton = runner(tiny_model, "triton")
    with pytest.raises(ValueError, match="need a CUDA device"):
        triton.decode_graphs((1, 2), capture=True)
    graphs = triton.decode_graphs((1, 2), capture=False)
    assert graphs.fits(2, graphs.max_blocks) and not graphs.fits(3, 1)
    assert not graphs.fits(1, graphs.max_blocks + 1)
