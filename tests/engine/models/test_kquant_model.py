"""A whole K-quant model: a small random-weight GGUF in the types of a Q4_K_M / Q5_K_M file.

Written in the test from random K-quant blocks (gguf-py writes GGUF files but cannot
quantize into K-types), with the default model's tokenizer: Llama-shaped, 2 layers,
hidden 256, q/k/gate/up in Q4_K, v and down in Q6_K (Q5_K in the second layer), the tied
embedding in Q6_K. Served natively (mapped blocks, int8 activations) its greedy tokens
agree with the fp32 path of the same weights (dequantized by transformers + gguf-py),
except where the fp32 path's own two best nearly tie: the first-divergence counts are
printed, and each divergence is checked to be such a tie.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tests.engine.kernels.test_kquant import random_kblocks
from tests.engine.models.test_gguf_weights import TOKENS, _greedy
from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.engine import EngineConfig, LLMEngine
from tokenrelay.engine.kernels.decoder import REPACK_SWITCH
from tokenrelay.engine.kernels.quant import QuantStack, QuantWeight, quant_kernel
from tokenrelay.engine.models.gguf_weights import native_unsupported
from tokenrelay.engine.models.store import default_gguf_path, locate_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time"]
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 512, 4, 2, 64, 2
GGML = gguf.GGMLQuantizationType
# d (and dmin) of about this give weights of ~0.07: activations and attention scores of
# order one, as in a trained model (larger ones saturate the softmax: chaotic tokens)
WEIGHT_SCALE = 0.0003


def _copy_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The default model's tokenizer and chat template, field by field."""
    reader = gguf.GGUFReader(default_gguf_path())
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                values: Any = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                values = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_array(name, values)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            value = field.parts[field.data[0]].tolist()[0]
            writer.add_key_value(name, value, kind)


def write_kquant_model(path: Path, seed: int = 0) -> Path:
    """A random Llama-shaped K-quant GGUF at ``path`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    _copy_tokenizer(writer)
    vocab = len(gguf.GGUFReader(default_gguf_path()).fields["tokenizer.ggml.tokens"].data)

    def quant(name: str, n: int, k: int, qtype: str) -> None:
        blocks = random_kblocks(n, k, qtype, rng, WEIGHT_SCALE)
        writer.add_tensor(name, blocks, raw_dtype=GGML[qtype])

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    quant("token_embd.weight", vocab, HIDDEN, "Q6_K")
    norm("output_norm.weight")
    for i in range(LAYERS):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        norm(p + "ffn_norm.weight")
        quant(p + "attn_q.weight", HEADS * HEAD_DIM, HIDDEN, "Q4_K")
        quant(p + "attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN, "Q4_K")
        quant(p + "attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN, "Q6_K")
        quant(p + "attn_output.weight", HIDDEN, HEADS * HEAD_DIM, "Q4_K")
        quant(p + "ffn_gate.weight", FFN, HIDDEN, "Q4_K")
        quant(p + "ffn_up.weight", FFN, HIDDEN, "Q4_K")
        quant(p + "ffn_down.weight", HIDDEN, FFN, "Q6_K" if i == 0 else "Q5_K")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = write_kquant_model(tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf")
    yield path
    _, _, target = locate_model(str(path))  # what the engine prepared for it: not kept
    assert target is not None
    for folder in (target, target.with_name(target.name + ".meta")):
        shutil.rmtree(folder, ignore_errors=True)
        Path(f"{folder}.lock").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def native(kquant_file: Path) -> Any:
    return LLMEngine(EngineConfig(model=str(kquant_file), device="cpu"))


def _in_a_map_of(address: int, path: Path) -> bool:
    """Whether ``address`` lies in a memory map of ``path`` (``/proc/self/maps``)."""
    target = str(path.resolve())
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_auto_serves_k_quants_natively_from_the_mapped_file(native: Any, kquant_file: Path) -> None:
    runner = native.runner
    assert runner.weights == "native"
    model = runner.model
    assert model.fused is not None  # every layer in one C call
    attn, mlp = model.layers[0].attn, model.layers[1].mlp
    assert isinstance(attn.qkv_packed, QuantStack)
    assert attn.qkv_packed.qtypes == ("Q4_K", "Q4_K", "Q6_K")
    assert isinstance(mlp.down_packed, QuantWeight) and mlp.down_packed.qtype == "Q5_K"
    assert model.embed_quant is not None and model.embed_quant.qtype == "Q6_K"
    # mapped, not copied: v, gate/up, o, down and the embedding point into the file's map;
    # q and k are copies (their rows un-permuted)
    mapped = [model.embed_quant, attn.qkv_packed.parts[2], attn.o_packed, mlp.down_packed,
              *mlp.gate_up_packed.parts]  # fmt: skip
    assert all(_in_a_map_of(w.data_ptr, kquant_file) for w in mapped)
    assert not any(_in_a_map_of(w.data_ptr, kquant_file) for w in attn.qkv_packed.parts[:2])
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert dense_bytes < 100_000  # norms only


# Where the greedy tokens part, the K-quant path's token must be among the fp32 path's best,
# this close to its first (log-prob). Quantizing activations to int8 per 256 values moves this
# random model's log-probs far more than fp32 rounding does (the same model in torch with
# fp32 weights and int8-rounded inputs gives the kernels' numbers exactly).
NEAR_TIE = 2.0


def _top(engine: Any, ids: list[int]) -> Any:
    """The engine's best next tokens after ``ids`` (its ``Logprobs``, five alternatives)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5)
    engine.add_request("top", ids, params)
    found = []
    while engine.has_unfinished():
        for o in engine.step():
            found.extend(o.new_logprobs or [])
    return found[0]


def test_greedy_tokens_agree_with_the_fp32_path(native: Any, kquant_file: Path) -> None:
    """Greedy tokens equal the fp32 path's up to a near tie: where they part, the token the
    K-quant path chose is one of the fp32 path's best, within NEAR_TIE of its first."""
    dense = LLMEngine(EngineConfig(model=str(kquant_file), device="cpu", weights="fp32"))
    assert dense.runner.weights == "float32"
    prompts = [list(native.tokenizer(p)["input_ids"]) for p in PROMPTS]  # the same ids for both
    got, want = _greedy(native, prompts), _greedy(dense, prompts)
    agree = [next((i for i, (a, b) in enumerate(zip(n, d, strict=True)) if a != b), TOKENS)
             for n, d in zip(got, want, strict=True)]  # fmt: skip
    print(f"K-quant native vs fp32: tokens agreeing before the first difference: {agree}")
    assert all(len(n) == TOKENS for n in got)
    for ids, n, d, i in zip(prompts, got, want, agree, strict=True):
        if i == TOKENS:
            continue
        top = _top(dense, ids + d[:i])  # the fp32 path where the two parted
        chosen = dense.token_texts(n[i])[1]
        options = {t.raw: t.logprob for t in top.top}
        assert chosen in options, (i, chosen, options)
        assert top.top[0].logprob - options[chosen] <= NEAR_TIE, (i, options)


def test_a_sequence_gets_the_same_tokens_alone_and_in_a_batch(native: Any) -> None:
    """Rows are quantized one by one: a prompt's greedy tokens do not depend on its batch."""
    together = _greedy(native, PROMPTS)
    alone = [_greedy(native, [p])[0] for p in PROMPTS]
    assert together == alone


def test_a_type_without_a_kernel_is_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenrelay.core import runtime

    writer = gguf.GGUFWriter(str(tmp_path / "q3.gguf"), "llama")
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((4, 110), dtype=np.uint8),
                      raw_dtype=GGML.Q3_K)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg = EngineConfig(model=str(tmp_path / "q3.gguf"), device="cpu")
    monkeypatch.setattr(runtime, "available_memory", lambda: 1024)
    with pytest.raises(ValueError) as err:
        cfg.weights_for("cpu")
    message = str(err.value)
    assert "\n" not in message
    assert "blk.0.ffn_down.weight is Q3_K" in message and "--weights fp32 would hold" in message
    monkeypatch.setattr(runtime, "available_memory", lambda: 2**40)
    assert cfg.weights_for("cpu") == "dense"  # it fits: dequantized, with a warning
    # a float16 matrix is no quantized block either (norms and biases are fine)
    writer = gguf.GGUFWriter(str(tmp_path / "f16.gguf"), "llama")
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float16))
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((8, HIDDEN), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    why = native_unsupported(tmp_path / "f16.gguf")
    assert why is not None and why.startswith("blk.0.ffn_down.weight is F16")


@pytest.mark.parametrize("threads", [1, 2])
def test_logits_do_not_change_with_threads(native: Any, threads: int) -> None:
    before = torch.get_num_threads()
    want = _greedy(native, PROMPTS[:2])
    try:
        torch.set_num_threads(threads)
        got = _greedy(native, PROMPTS[:2])
    finally:
        torch.set_num_threads(before)
    assert got == want


def test_q4_k_repacked_for_the_kernel_gives_the_same_tokens(
    native: Any, kquant_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the build has AVX512-VNNI, the fused decoder multiplies Q4_K projections
    repacked 16 rows at a time; the file's own blocks (the switch off) give the same
    greedy tokens (the same integer sums, the fp32 scaling in another order)."""
    kernel, gate = quant_kernel(), native.runner.model.layers[0].mlp.gate_up_packed.parts[0]
    if kernel is None or kernel.interleave(gate) is None:
        pytest.skip("no repacked Q4_K form in this build (no AVX512-VNNI)")
    copies = [t for t in native.runner.model.fused._keep if isinstance(t, torch.Tensor)
              and t.dtype == torch.uint8]  # fmt: skip
    assert copies  # q, k, o, gate and up of each layer
    monkeypatch.setenv(REPACK_SWITCH, "0")
    plain = LLMEngine(EngineConfig(model=str(kquant_file), device="cpu"))
    assert not [t for t in plain.runner.model.fused._keep if isinstance(t, torch.Tensor)
                and t.dtype == torch.uint8]  # fmt: skip
    assert _greedy(native, PROMPTS) == _greedy(plain, PROMPTS)
