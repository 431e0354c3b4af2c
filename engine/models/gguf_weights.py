"""Load a GGUF file's weights into :class:`engine.models.llama.CausalLM` as they are: quantized.

The projections (and the token embedding, which is also the tied LM head) stay in
the file's block format (:data:`engine.kernels.quant.QUANT_TYPES`: Q4_0, Q4_1, Q8_0
and the K-quants Q4_K, Q5_K, Q6_K) as :class:`engine.kernels.quant.QuantWeight` and
are multiplied by the C kernels of ``engine/kernels/csrc``; only the norms and biases
(F32 in the file) become dense tensors. Nothing is dequantized to fp32.

What is mapped and what is copied: every quantized tensor is a read-only view of the
file's memory map (``GGUFIndex``), so the weights cost what the file does, shared with
the page cache, and a second start reads nothing twice. Fused projections are not
concatenated: q/k/v and gate/up are a :class:`engine.kernels.quant.QuantStack` of their
mapped parts, which may differ in type (a Q4_K_M file keeps some layers' v in Q6_K).
Copied: the norms (fp32), and the q and k projections of Llama/Mistral files, whose
rows llama.cpp's converter permutes for its rotary layout: the permutation is undone
on whole rows of blocks into a copy, and the mapped pages of the original are dropped
from resident memory (``GGUFIndex.release``).

The architecture comes from the ``config.json`` prepared next to the tokenizer
(:func:`engine.models.store.resolve_model_metadata`); the tensors are matched by
their GGUF names.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenrelay.engine.kernels.quant import QUANT_TYPES, QuantStack, QuantWeight
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.families import model_class
from tokenrelay.engine.models.gguf_file import GGUFIndex
from tokenrelay.engine.models.gguf_meta import DENSE_ARCHITECTURES
from tokenrelay.engine.models.llama import CausalLM

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
# GGUF name (per layer) -> our parameter name, for the tensors that stay dense
_DENSE = {
    "attn_norm.weight": "input_norm.weight",
    "ffn_norm.weight": "post_attn_norm.weight",
    "attn_q_norm.weight": "attn.q_norm.weight",
    "attn_k_norm.weight": "attn.k_norm.weight",
    "attn_output.bias": "attn.o_bias",
    "ffn_down.bias": "mlp.down_bias",
}
_FUSED_BIAS = {
    "attn.qkv_bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "mlp.gate_up_bias": ("ffn_gate.bias", "ffn_up.bias"),
}
_PERMUTED_ARCHS = ("llama", "mistral")  # q/k rows permuted by llama.cpp's converter


def unpermute_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """Row index that undoes llama.cpp's rotary permutation of a q or k projection.

    The converter reorders each head's rows from ``[half0 | half1]`` interleaving to
    pairs; ``w_hf = w_gguf[index]``.
    """
    dim = n_rows // n_heads // 2
    return torch.arange(n_rows).reshape(n_heads, dim, 2).transpose(1, 2).reshape(n_rows)


class GGUFTensors:
    """The tensors of one GGUF file by name: quantized ones as :class:`QuantWeight`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.index = GGUFIndex(path)
        self.arch = self.index.arch

    def names(self) -> set[str]:
        return set(self.index.tensors)

    def quant(self, name: str) -> QuantWeight:
        """Tensor ``name`` as a quantized matrix ``[N, K]`` (refused if it is not one)."""
        t = self.index.tensors[name]
        qtype = t.type_name
        if qtype not in QUANT_TYPES or len(t.shape) != 2:
            raise ValueError(
                f"model: {name} in {self.path.name} is {qtype}; native weights support "
                f"{', '.join(QUANT_TYPES)} matrices (use --weights fp32)"
            )
        n, k = t.shape[1], t.shape[0]  # GGUF lists dims innermost first
        with warnings.catch_warnings():  # the view is read-only, and nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(self.index.data(name)).reshape(n, -1)
        return QuantWeight(data, qtype, n, k)

    def dense(self, name: str) -> torch.Tensor:
        """Tensor ``name`` (F32 or F16 in the file) as an fp32 tensor, GGUF dims reversed."""
        t = self.index.tensors[name]
        if t.type_name not in ("F32", "F16"):
            raise ValueError(f"model: {name} in {self.path.name} is {t.type_name}")
        raw = self.index.data(name).view(np.float32 if t.type_name == "F32" else np.float16)
        shape = [int(d) for d in reversed(t.shape)]
        return torch.from_numpy(raw.astype(np.float32)).reshape(shape)


def fp32_bytes(index: GGUFIndex) -> int:
    """What the file's tensors take dequantized to fp32 (what ``--weights fp32`` holds)."""
    return 4 * sum(int(np.prod(t.shape, dtype=np.int64)) for t in index.tensors.values())


def native_unsupported(path: Path, index: GGUFIndex | None = None) -> str | None:
    """Why ``path`` cannot be served as it is (a family the fused decoder does not compute,
    a tensor type we do not multiply), or None.

    One line naming the family, or the first such tensor and its type, and what
    ``--weights fp32`` would cost in memory instead. ``index``: the file's, where the
    caller has it.
    """
    index = index if index is not None else GGUFIndex(path)
    if index.arch in DENSE_ARCHITECTURES:
        gib = fp32_bytes(index) / 2**30
        return (
            f"a {index.arch} file runs op by op, dequantized (the fused decoder computes "
            f"Llama's layer only): {gib:.1f} GiB of fp32 weights instead of the file's "
            f"{path.stat().st_size / 2**30:.1f} GiB"
        )
    for t in index.tensors.values():
        kind = t.type_name
        vector = kind in ("F32", "F16") and len(t.shape) == 1  # norms and biases stay dense
        if kind not in QUANT_TYPES and not vector:
            gib = fp32_bytes(index) / 2**30
            return (
                f"{t.name} is {kind}, which the CPU kernels do not multiply (they do "
                f"{', '.join(QUANT_TYPES)}); --weights fp32 would hold {gib:.1f} GiB of "
                f"dequantized weights instead of the file's {path.stat().st_size / 2**30:.1f} GiB"
            )
    return None


def check_native(path: Path) -> None:
    """Refuse ``weights=native`` in one line for a GGUF of a family served dense only."""
    arch = GGUFIndex(path).arch
    if arch in DENSE_ARCHITECTURES:
        raise ValueError(
            f"weights=native: a {arch} GGUF runs dense, op by op (the fused decoder "
            "computes Llama's layer only): use weights auto or fp32"
        )


def _projection(g: GGUFTensors, prefix: str, name: str, heads: int | None) -> QuantWeight:
    w = g.quant(prefix + name)
    if heads is not None and g.arch in _PERMUTED_ARCHS:
        w = w.take_rows(unpermute_rows(w.n, heads))  # a copy: drop the mapped original
        g.index.release(prefix + name)
    return w


def load_gguf_model(path: Path, cfg: ModelConfig) -> CausalLM:
    """Build :class:`CausalLM` for ``cfg`` on the CPU with ``path``'s quantized weights
    (Llama-shaped families only: gguf_meta.py's ``ARCHITECTURES``)."""
    check_native(path)
    if model_class(cfg) is not CausalLM:
        raise ValueError(f"model: GGUF weights of model_type {cfg.model_type} are not supported")
    g = GGUFTensors(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    names = g.names()
    dense: dict[str, torch.Tensor] = {"norm.weight": g.dense("output_norm.weight")}
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        if p + "attn_q.weight" not in names:
            raise ValueError(f"model: {path.name} has no layer {i} (config: {cfg.num_layers})")
        for gguf_name, ours in _DENSE.items():
            if p + gguf_name in names:
                dense[f"layers.{i}.{ours}"] = g.dense(p + gguf_name)
        for ours, parts in _FUSED_BIAS.items():
            if all(p + n in names for n in parts):
                dense[f"layers.{i}.{ours}"] = torch.cat([g.dense(p + n) for n in parts])
        attn: Any = layer.attn  # type: ignore[union-attr]
        mlp: Any = layer.mlp  # type: ignore[union-attr]
        attn.qkv_packed = QuantStack(
            [
                _projection(g, p, "attn_q.weight", cfg.num_heads),
                _projection(g, p, "attn_k.weight", cfg.num_kv_heads),
                _projection(g, p, "attn_v.weight", None),
            ]
        )
        attn.o_packed = g.quant(p + "attn_output.weight")
        mlp.gate_up_packed = QuantStack(
            [g.quant(p + "ffn_gate.weight"), g.quant(p + "ffn_up.weight")]
        )
        mlp.down_packed = g.quant(p + "ffn_down.weight")
        for holder, attr in ((attn, "qkv_weight"), (attn, "o_weight"),
                             (mlp, "gate_up_weight"), (mlp, "down_weight")):  # fmt: skip
            setattr(holder, attr, torch.nn.Parameter(torch.empty(0), requires_grad=False))
    extra = sorted(n for n in names if (m := _BLOCK.match(n)) and int(m.group(1)) >= cfg.num_layers)
    if extra:
        raise ValueError(f"model: {path.name} has layers beyond the config's {cfg.num_layers}")
    model.embed_quant = g.quant("token_embd.weight")
    if cfg.tie_word_embeddings or "output.weight" not in names:
        model.head_packed = model.embed_quant
    else:
        model.head_packed = g.quant("output.weight")
    model.embed = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    if model.lm_head is not None:
        model.lm_head = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    expected = {name: p for name, p in model.named_parameters() if p.is_meta and p.numel() > 0}
    missing = sorted(set(expected) - set(dense))
    if missing:
        raise ValueError(f"model: {path.name} lacks weights for {missing[:4]}")
    for name, tensor in dense.items():
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"model: {name} has shape {tuple(tensor.shape)} in {path.name}")
    model.load_state_dict(dense, strict=False, assign=True)
    for param in model.parameters():
        param.requires_grad_(False)
    model.init_rope(torch.device("cpu"))
    return model.eval()
