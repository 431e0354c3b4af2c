"""engine/models/gguf_weights.py: the default model served from its quantized blocks.

The native path and the fp32 path hold the same numbers (transformers dequantizes
the same blocks the kernels read), so their logits differ only by the order of
the fp32 sums; greedy text may part late, where two logits nearly tie.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.engine import EngineConfig, LLMEngine
from tokenrelay.engine.models.gguf_weights import unpermute_rows

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4,",
]
TOKENS = 16


def _reference_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # the inverse of llama.cpp's converter, as transformers writes it
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


@pytest.mark.parametrize(("rows", "heads"), [(576, 9), (192, 3), (128, 2), (64, 1)])
def test_unpermute_matches_the_reference(rows: int, heads: int) -> None:
    w = torch.randn(rows, 8)
    assert torch.equal(w[unpermute_rows(rows, heads)], _reference_unpermute(w, heads))


@pytest.fixture(scope="module")
def native_engine() -> Any:
    return LLMEngine(EngineConfig(model="default", device="cpu", weights="native"))


def _greedy(engine: Any, prompts: list[str], tokens: int = TOKENS) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, params)
    out: dict[str, list[int]] = {f"g{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[f"g{i}"] for i in range(len(prompts))]


def test_native_weights_stay_quantized(native_engine: Any) -> None:
    model = native_engine.runner.model
    assert native_engine.runner.weights == "native"
    assert model.embed_quant is not None and model.embed.numel() == 0
    layer = model.layers[0]
    assert layer.mlp.down_weight.numel() == 0 and layer.attn.qkv_weight.numel() == 0
    assert not isinstance(layer.mlp.down_packed, torch.Tensor)  # a quantized matrix
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert dense_bytes < 2_000_000  # norms only: the 135M weights are not in fp32


def test_native_logits_match_the_fp32_path(native_engine: Any, llm_engine: Any) -> None:
    ids = native_engine.tokenizer("The capital of France is", return_tensors="pt")["input_ids"][0]
    logits = []
    for engine in (native_engine, llm_engine):
        model = engine.runner.model
        with torch.inference_mode():
            emb = (
                model.embed_quant.rows(ids)
                if model.embed_quant is not None
                else torch.nn.functional.embedding(ids, model.embed)
            )
            logits.append(model.compute_logits(model.norm(emb)))
    # the embedding and the tied head: the same dequantized numbers either way
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-3)


def test_greedy_text_agrees_with_the_fp32_path(native_engine: Any, llm_engine: Any) -> None:
    native, dense = _greedy(native_engine, PROMPTS), _greedy(llm_engine, PROMPTS)
    agree = [next((i for i, (a, b) in enumerate(zip(n, d, strict=True)) if a != b), TOKENS)
             for n, d in zip(native, dense, strict=True)]  # fmt: skip
    print(f"native vs fp32: tokens agreeing before the first difference: {agree}")
    assert all(n for n in native)
    assert sum(agree) >= TOKENS * len(PROMPTS) // 2, agree
    assert max(agree) == TOKENS, agree


def test_the_fused_decoder_gives_the_op_by_op_tokens(native_engine: Any) -> None:
    model = native_engine.runner.model
    fused = model.fused
    assert fused is not None  # native GGUF weights run every layer in one C call
    with_fused = _greedy(native_engine, PROMPTS)
    model.fused = None
    try:
        op_by_op = _greedy(native_engine, PROMPTS)
    finally:
        model.fused = fused
    agree = [next((i for i, (a, b) in enumerate(zip(f, o, strict=True)) if a != b), TOKENS)
             for f, o in zip(with_fused, op_by_op, strict=True)]  # fmt: skip
    print(f"fused vs op-by-op: tokens agreeing before the first difference: {agree}")
    # the same kernels; only the order of fp32 sums in norms and attention differs
    assert sum(agree) >= TOKENS * len(PROMPTS) * 3 // 4, agree


def test_native_needs_a_gguf_model(model_path: Any) -> None:
    with pytest.raises(ValueError, match="gguf"):
        EngineConfig(model=str(model_path), weights="native")
    with pytest.raises(ValueError, match="weights"):
        EngineConfig(model="default", weights="int3")


def test_auto_is_native_for_a_gguf_on_the_cpu(model_path: Any, tmp_path: Any) -> None:
    from tokenrelay.engine.models.gguf_weights import native_unsupported
    from tokenrelay.engine.models.store import default_gguf_path

    assert native_unsupported(default_gguf_path()) is None
    auto = EngineConfig(model="default")
    assert auto.weights_for("cpu") == "native"
    assert auto.weights_for("cuda") == "dense"  # the quantized kernels are CPU code
    assert EngineConfig(model="default", dtype="bf16").weights_for("cpu") == "dense"
    assert EngineConfig(model="default", weights="fp32").weights_for("cpu") == "fp32"
    assert EngineConfig(model=str(model_path)).weights_for("cpu") == "dense"  # a HF folder


def test_auto_dequantizes_a_gguf_with_other_tensor_types(tmp_path: Any) -> None:
    import gguf as gg
    import numpy as np

    from tokenrelay.engine.models.gguf_weights import native_unsupported

    path = tmp_path / "mixed.gguf"
    writer = gg.GGUFWriter(str(path), "llama")
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    raw = np.zeros((4, 84), dtype=np.uint8)  # one Q2_K super-block (84 bytes) per row
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=gg.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    why = native_unsupported(path)
    assert why is not None and "blk.0.ffn_down.weight is Q2_K" in why


def test_the_gguf_index_reads_what_gguf_reads(tmp_path: Path) -> None:
    """engine/models/gguf_file.py against gguf's own reader: metadata of every kind (string
    arrays skipped), tensors of several types, their bytes."""
    gg = pytest.importorskip("gguf")
    import numpy as np

    from tokenrelay.engine.models.gguf_file import GGUFIndex

    path = tmp_path / "tiny.gguf"
    writer = gg.GGUFWriter(str(path), "qwen3")
    writer.add_uint32("qwen3.block_count", 2)
    writer.add_float32("qwen3.rope.freq_base", 1e6)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_token_list(["<s>", "hello", "wörld"] * 50)
    writer.add_array("tokenizer.ggml.token_type", [1, 2, 3] * 50)
    writer.add_string("general.name", "tiny")
    rng = np.random.default_rng(0)
    writer.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float16))
    q = rng.integers(0, 255, (8, 2 * 20), dtype=np.uint8)  # 8 rows of two Q4_1 blocks
    writer.add_tensor("blk.0.attn_q.weight", q, raw_dtype=gg.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    index = GGUFIndex(path)
    assert index.arch == "qwen3" and index.metadata["qwen3.block_count"] == 2
    assert index.metadata["general.name"] == "tiny"
    assert "tokenizer.ggml.tokens" not in index.metadata  # arrays are skipped
    reader = gg.GGUFReader(str(path))
    assert set(index.tensors) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        mine = index.tensors[t.name]
        assert mine.type_name == t.tensor_type.name
        assert mine.shape == tuple(int(d) for d in t.shape)
        want = np.asarray(t.data).view(np.uint8).reshape(-1)
        assert np.array_equal(index.data(t.name), want)
    assert index.tensors["blk.0.attn_q.weight"].shape == (64, 8)


def test_a_broken_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    from tokenrelay.engine.models.gguf_file import GGUFIndex

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTGGUF" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFIndex(bad)
    good = tmp_path / "cut.gguf"
    good.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (5).to_bytes(8, "little") * 2)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        GGUFIndex(good)
    # an array claiming 2**62 uint32 values: an offset past what an index can hold
    huge = tmp_path / "huge.gguf"
    key = b"k"
    huge.write_bytes(
        b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (2).to_bytes(8, "little")
        + len(key).to_bytes(8, "little") + key + (9).to_bytes(4, "little")
        + (4).to_bytes(4, "little") + (2**62).to_bytes(8, "little")
        + len(key).to_bytes(8, "little") + key + (4).to_bytes(4, "little") + bytes(4)
    )  # fmt: skip
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        GGUFIndex(huge)
