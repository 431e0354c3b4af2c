"""A GGUF file dequantized into a Hugging Face folder with our own reader: the path of
``--weights fp32`` (and of a file holding tensor types the quantized kernels do not
multiply) for Granite, OLMo 2, Phi-3, Gemma 2 and Gemma 3.

transformers' GGUF loader has no mapping for some of these architectures, so the file is
prepared here, as ``store.convert_gguf`` prepares any GGUF served dense: every tensor
dequantized to fp32 (gguf-py's dequantizers, any ggml type they know), renamed to its
checkpoint name, written as ``model.safetensors`` beside the ``config.json`` and
tokenizer that ``gguf_meta.write_metadata`` reads from the header. The folder then loads
like any Hugging Face folder (``weights.py``): op by op, on a CPU or a GPU, in the dtype
asked for. (Served as they are, the same files go through ``gguf_weights.py``.)

The names, and what the converter changed on the way (Granite's permuted q/k rows,
Gemma's norms stored as ``w + 1``, Phi-3's fused ``attn_qkv`` and ``ffn_up``, Gemma's
``ffn_norm`` before the MLP), are ``gguf_names.py``'s, shared with the native loader;
this module undoes the permutation and the offset on the dequantized tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tokenrelay.engine.models.gguf_file import GGUFIndex
from tokenrelay.engine.models.gguf_meta import write_metadata
from tokenrelay.engine.models.gguf_names import (
    checkpoint_names,
    norm_offset,
    rotary_heads,
    unpermute_rows,
)

# the architectures dequantized here (transformers' GGUF loader does the Llama-shaped ones)
ARCHITECTURES = ("granite", "olmo2", "phi3", "gemma2", "gemma3")


def dequantized(index: GGUFIndex, name: str) -> torch.Tensor:
    """Tensor ``name`` of ``index`` in fp32, in the checkpoint's shape (GGUF dims reversed)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    info = index.tensors[name]
    try:
        qtype = GGMLQuantizationType[info.type_name]
    except KeyError:
        raise ValueError(f"model: {name} in {index.path.name} is {info.type_name}") from None
    shape = [int(d) for d in reversed(info.shape)]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    raw = np.asarray(index.data(name)).reshape(rows, -1)
    values = np.array(dequantize(raw, qtype), dtype=np.float32)  # a copy: not the file's map
    return torch.from_numpy(values).reshape(shape)


def checkpoint_tensors(index: GGUFIndex) -> dict[str, torch.Tensor]:
    """Every weight of ``index`` in fp32 under its Hugging Face checkpoint name: Gemma's
    norms less the converter's 1, Granite's q and k rows in the checkpoint's order."""
    if index.arch not in ARCHITECTURES:
        raise ValueError(
            f"model: {index.path.name}: architecture {index.arch!r} is not prepared here"
        )
    out: dict[str, torch.Tensor] = {}
    for name, target in checkpoint_names(index).items():
        tensor = dequantized(index, name)
        offset = norm_offset(index.arch, name)
        if offset:
            tensor -= offset  # exact for stored values in [0.5, 2] (weights in [-0.5, 1])
        heads = rotary_heads(index, name)
        if heads is not None:  # a q or k weight [rows, ...] or bias [rows]
            tensor = tensor[unpermute_rows(tensor.shape[0], heads)].contiguous()
        out[target] = tensor
    return out


def write_dense(gguf: Path, out: Path, progress: Callable[[str], None] = lambda line: None) -> None:
    """``gguf`` as a Hugging Face folder in ``out``: config, tokenizer, fp32 safetensors."""
    from safetensors.torch import save_file

    write_metadata(gguf, out, progress)
    started = time.monotonic()
    tensors = checkpoint_tensors(GGUFIndex(gguf))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    size = sum(t.numel() for t in tensors.values()) * 4 / 2**30
    progress(f"{len(tensors)} tensors dequantized to fp32, {size:.2f} GiB "
             f"({time.monotonic() - started:.1f} s)")  # fmt: skip
