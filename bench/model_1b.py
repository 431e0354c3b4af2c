"""A 1B-class GGUF test file for bench/vs_llamacpp.py: random weights, a real tokenizer.

Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 query / 8 KV heads of 64, FFN 8192,
tied embeddings, rope theta 500000, RMS eps 1e-5) with the default model's tokenizer
(SmolLM2's, vocab 49152: its ``tokenizer.*`` keys and chat template copied from the
default model's GGUF), weights drawn from N(0, 0.02) with a fixed seed per tensor (norms
1), written as an F16 GGUF with gguf-py, then quantized with llama.cpp's
``llama-quantize`` (cached beside llama-server by bench/vs_llamacpp.py) to Q4_K_M or
Q8_0. The same seed gives the same bytes; the files are cached under
``~/.cache/tokenrelay-bench/models/``. The text such a model writes is noise, but it
costs what a trained model of the shape costs, which is what the bench measures.

    .venv/bin/python -m bench.vs_llamacpp --make-model 1b --quant Q4_K_M   # prints the path
    .venv/bin/python -m bench.vs_llamacpp --model 1b-q4_k_m ...            # makes it if needed
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MODELS = Path.home() / ".cache" / "tokenrelay-bench" / "models"
FORMAT = 1  # bump when the writer changes what it writes: the cached files' names change
QUANTS = ("F16", "Q8_0", "Q4_K_M")
STD = 0.02


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    context: int = 32768  # admits the bench's 8k+ long prompts

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),  # Llama-3.2-1B
    "tiny": Shape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512),  # for the tests
}


def model_path(shape: str, quant: str, seed: int = 0, folder: Path = MODELS) -> Path:
    return folder / f"llama-{shape}-random-s{seed}-v{FORMAT}.{quant}.gguf"


def parse_shortcut(name: str) -> tuple[str, str] | None:
    """``1b-q4_k_m`` -> ("1b", "Q4_K_M"); None when ``name`` is no such shortcut."""
    shape, _, quant = name.partition("-")
    if shape in SHAPES and quant.upper() in QUANTS:
        return shape, quant.upper()
    return None


def tensors(shape: Shape, vocab: int) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape [rows, cols], is a norm) in GGUF order; tied: no output.weight."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    yield "token_embd.weight", (vocab, h), False
    yield "output_norm.weight", (h,), True
    for i in range(shape.layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (h,), True
        yield b + "attn_q.weight", (h, h), False
        yield b + "attn_k.weight", (kv, h), False
        yield b + "attn_v.weight", (kv, h), False
        yield b + "attn_output.weight", (h, h), False
        yield b + "ffn_norm.weight", (h,), True
        yield b + "ffn_gate.weight", (shape.ffn, h), False
        yield b + "ffn_up.weight", (shape.ffn, h), False
        yield b + "ffn_down.weight", (h, shape.ffn), False


def tensor_data(index: int, dims: tuple[int, ...], norm: bool, seed: int) -> np.ndarray:
    if norm:
        return np.ones(dims, dtype=np.float32)
    rng = np.random.default_rng([seed, index])  # one stream per tensor: streamable, stable
    return (rng.standard_normal(dims, dtype=np.float32) * STD).astype(np.float16)


def write_f16(path: Path, shape_name: str, tokenizer_gguf: Path, seed: int = 0) -> Path:
    """Write the random F16 GGUF of ``SHAPES[shape_name]`` to ``path`` (atomically)."""
    import gguf

    shape = SHAPES[shape_name]
    src = gguf.GGUFReader(str(tokenizer_gguf))
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_type("model")
    w.add_name(f"random Llama-3.2-1B-shaped test model ({shape_name}, seed {seed})")
    w.add_size_label(shape_name.upper())
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, field in src.fields.items():  # the tokenizer and its chat template, as they are
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), vtype)
    plan = list(tensors(shape, vocab))
    for name, dims, norm in plan:
        dtype = np.dtype(np.float32 if norm else np.float16)
        w.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for index, (_name, dims, norm) in enumerate(plan):
        w.write_tensor_data(tensor_data(index, dims, norm, seed))
    w.close()
    tmp.replace(path)
    return path


def quantize(binary: Path, f16: Path, out: Path, quant: str, threads: int) -> Path:
    tmp = out.with_name(out.name + ".tmp")
    env = dict(os.environ)  # a shared build's libraries lie next to the binary
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        x for x in (str(binary.parent), env.get("LD_LIBRARY_PATH")) if x
    )
    proc = subprocess.run(
        [str(binary), str(f16), str(tmp), quant, str(threads)],
        capture_output=True, text=True, timeout=3600, env=env,
    )  # fmt: skip
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"llama-quantize {quant} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    tmp.replace(out)
    return out


def make_model(
    shape: str,
    quant: str,
    tokenizer_gguf: Path,
    quantize_binary: Callable[[], Path],
    seed: int = 0,
    threads: int = 2,
    folder: Path = MODELS,
    say: Callable[..., None] = print,
) -> Path:
    """The cached file of ``shape`` in ``quant``, made (F16 first) when missing."""
    quant = quant.upper()
    if shape not in SHAPES or quant not in QUANTS:
        raise SystemExit(f"no test model {shape} {quant}: shapes {list(SHAPES)}, quants {QUANTS}")
    f16 = model_path(shape, "F16", seed, folder)
    if not f16.is_file():
        say(f"writing {f16} (random N(0, {STD}) weights, seed {seed}, {tokenizer_gguf.name}'s "
            "tokenizer)")  # fmt: skip
        write_f16(f16, shape, tokenizer_gguf, seed)
    if quant == "F16":
        return f16
    out = model_path(shape, quant, seed, folder)
    if not out.is_file():
        binary = quantize_binary()
        say(f"quantizing to {quant} with {binary}: {out}")
        quantize(binary, f16, out, quant, threads)
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def gguf_kv_shape(path: Path) -> dict[str, int]:
    """Layers, KV heads and head dim of a GGUF file (to size a KV pool in tokens)."""
    import gguf

    r = gguf.GGUFReader(str(path))

    def get(key: str) -> int | None:
        field = r.fields.get(key)
        return None if field is None else int(field.contents())

    arch = str(r.fields["general.architecture"].contents())
    heads = get(f"{arch}.attention.head_count") or 1
    head_dim = get(f"{arch}.attention.key_length") or (
        (get(f"{arch}.embedding_length") or 0) // heads
    )
    return {
        "layers": get(f"{arch}.block_count") or 0,
        "kv_heads": get(f"{arch}.attention.head_count_kv") or heads,
        "head_dim": head_dim,
    }
