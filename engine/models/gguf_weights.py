"""Load a GGUF file's weights into its family's :class:`engine.models.llama.CausalLM` as
they are: quantized.

Every architecture of ``gguf_meta.ARCHITECTURES`` (Llama, Mistral, Qwen2, Qwen3, Granite,
OLMo 2, Phi-3, Gemma 2, Gemma 3) is built as ``families.model_class`` picks it and filled
from the file: the projections (and the token embedding, also the tied LM head) stay in
the file's block format (:data:`engine.kernels.quant.QUANT_TYPES`: Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K) as
:class:`engine.kernels.quant.QuantWeight` and are multiplied by the C kernels of
``engine/kernels/csrc``; only the norms and biases (F32 in the file) become dense tensors.
Nothing is dequantized to fp32. A family the fused decoder does not compute runs the same
weights op by op (``CausalLM.fuse``).

Names: each tensor's checkpoint name (``gguf_names.checkpoint_names``, shared with the
dense path ``gguf_dense.py``), then ours (``weights.LAYER_NAMES`` and ``weights.FUSED``,
shared with the safetensors loader), so a family's layout is said once.

What is mapped and what is copied: every quantized tensor is a read-only view of the
file's memory map (``GGUFIndex``), so the weights cost what the file does, shared with
the page cache, and a second start reads nothing twice. Fused projections are not
concatenated: q/k/v and gate/up are a :class:`engine.kernels.quant.QuantStack` of their
mapped parts, which may differ in type (a Q4_K_M file keeps some layers' v in Q6_K);
Phi-3's are one tensor in the file already (``attn_qkv``, ``ffn_up``: one QuantWeight).
Copied: the norms and biases (fp32; Gemma's less the 1 its converter added), and the q
and k projections of Llama, Mistral and Granite files, whose rows llama.cpp's converter
permutes for its rotary layout: the permutation is undone on whole rows of blocks into a
copy, and the mapped pages of the original are dropped from resident memory
(``GGUFIndex.release``).

The architecture comes from the ``config.json`` prepared next to the tokenizer
(:func:`engine.models.store.resolve_gguf`).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import torch

from tokenrelay.engine.kernels.quant import QUANT_TYPES, QuantStack, QuantWeight
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.families import model_class
from tokenrelay.engine.models.gguf_file import GGUFIndex
from tokenrelay.engine.models.gguf_names import (
    checkpoint_names,
    norm_offset,
    rotary_heads,
    unpermute_rows,
)
from tokenrelay.engine.models.llama import CausalLM
from tokenrelay.engine.models.weights import FUSED, LAYER_NAMES

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# (our name within a layer, the checkpoint's tensors it is made of, in order); Phi-3's
# fused q/k/v and gate/up are one tensor, the others' parts (weights.py's tables)
_SOURCES: list[tuple[str, tuple[str, ...]]] = [
    *((ours, (hf,)) for hf, ours in LAYER_NAMES.items()),
    *FUSED.items(),
]
# the projections kept quantized: our dense weight -> (submodule, attribute of the blocks)
_PROJECTIONS = {
    "attn.qkv_weight": ("attn", "qkv_packed"),
    "attn.o_weight": ("attn", "o_packed"),
    "mlp.gate_up_weight": ("mlp", "gate_up_packed"),
    "mlp.down_weight": ("mlp", "down_packed"),
}


class GGUFTensors:
    """The tensors of one GGUF file by name: quantized ones as :class:`QuantWeight`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.index = GGUFIndex(path)
        self.arch = self.index.arch

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

    def matrix(self, name: str) -> QuantWeight:
        """Tensor ``name`` quantized, its rows in the checkpoint's order (q and k of the
        families whose converter permutes them: a copy, the mapped pages dropped)."""
        w = self.quant(name)
        heads = rotary_heads(self.index, name)
        if heads is not None:
            w = w.take_rows(unpermute_rows(w.n, heads))
            self.index.release(name)
        return w

    def vector(self, name: str) -> torch.Tensor:
        """A norm or bias as the checkpoint holds it: Gemma's norms less the converter's 1,
        the q and k biases of a permuting family in the checkpoint's order."""
        t = self.dense(name)
        offset = norm_offset(self.arch, name)
        if offset:
            t -= offset  # exact for stored values in [0.5, 2] (weights in [-0.5, 1])
        heads = rotary_heads(self.index, name)
        return t if heads is None else t[unpermute_rows(t.shape[0], heads)]


def fp32_bytes(index: GGUFIndex) -> int:
    """What the file's tensors take dequantized to fp32 (what ``--weights fp32`` holds)."""
    return 4 * sum(int(np.prod(t.shape, dtype=np.int64)) for t in index.tensors.values())


def native_unsupported(path: Path, index: GGUFIndex | None = None) -> str | None:
    """Why ``path`` cannot be served as it is (a tensor type the kernels do not multiply),
    or None.

    One line naming the first such tensor and its type, and what ``--weights fp32`` would
    cost in memory instead. ``index``: the file's, where the caller has it.
    """
    index = index if index is not None else GGUFIndex(path)
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
    """Refuse ``weights=native`` in one line for a file holding a tensor type the kernels
    do not multiply (before anything is prepared)."""
    why = native_unsupported(path)
    if why is not None:
        raise ValueError(f"weights=native: {why}; use weights auto or fp32")


def load_gguf_model(path: Path, cfg: ModelConfig) -> CausalLM:
    """Build ``cfg``'s family (``families.model_class``) on the CPU with ``path``'s
    quantized weights."""
    g = GGUFTensors(path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    expected = dict(model.named_parameters())
    layers: dict[int, dict[str, str]] = {}  # layer -> checkpoint name in it -> GGUF name
    top: dict[str, str] = {}  # checkpoint name -> GGUF name, outside the layers
    for name, hf in checkpoint_names(g.index).items():
        if m := _HF_LAYER.match(hf):
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = name
        else:
            top[hf] = name
    if any(i >= cfg.num_layers for i in layers):
        raise ValueError(f"model: {path.name} has layers beyond the config's {cfg.num_layers}")
    used = set(top.values())
    dense: dict[str, torch.Tensor] = {}
    quant: dict[str, QuantWeight | QuantStack] = {}
    for i in range(cfg.num_layers):
        parts = layers.get(i)
        if parts is None:
            raise ValueError(f"model: {path.name} has no layer {i} (config: {cfg.num_layers})")
        for ours, sources in _SOURCES:
            if not all(hf in parts for hf in sources):
                continue
            names = [parts[hf] for hf in sources]
            used.update(names)
            key = f"layers.{i}.{ours}"
            if ours in _PROJECTIONS:
                mats = [g.matrix(n) for n in names]
                quant[key] = mats[0] if len(mats) == 1 else QuantStack(mats)
            else:
                dense[key] = torch.cat([g.vector(n) for n in names])
        unused = sorted(set(parts.values()) - used)
        if unused:
            raise ValueError(
                f"model: {path.name} has {unused[0]}, which a {cfg.model_type} model does not use"
            )
    if "model.norm.weight" in top:
        dense["norm.weight"] = g.vector(top["model.norm.weight"])
    if "model.embed_tokens.weight" not in top:
        raise ValueError(f"model: {path.name} has no token_embd.weight")
    embed = quant["embed"] = g.quant(top["model.embed_tokens.weight"])
    head = embed  # tied, or a file without output.weight
    if "lm_head.weight" in top and not cfg.tie_word_embeddings:
        head = g.quant(top["lm_head.weight"])
    if model.lm_head is not None:
        quant["lm_head"] = head
    _check_shapes(path, expected, dense, quant)
    for key, w in quant.items():
        if key.startswith("layers."):
            _, layer, ours = key.split(".", 2)
            holder, attr = _PROJECTIONS[ours]
            module = model.get_submodule(f"layers.{layer}.{holder}")
            setattr(module, attr, w)
            setattr(module, ours.split(".")[1], _placeholder())
    model.embed_quant, model.head_packed = embed, head
    model.embed = _placeholder()
    if model.lm_head is not None:
        model.lm_head = _placeholder()
    model.load_state_dict(dense, strict=False, assign=True)
    for param in model.parameters():
        param.requires_grad_(False)
    model.init_rope(torch.device("cpu"))
    return model.eval()


def _placeholder() -> torch.nn.Parameter:
    """What stands for a dense weight held quantized elsewhere (no elements)."""
    return torch.nn.Parameter(torch.empty(0), requires_grad=False)


def _check_shapes(
    path: Path,
    expected: dict[str, torch.nn.Parameter],
    dense: dict[str, torch.Tensor],
    quant: dict[str, QuantWeight | QuantStack],
) -> None:
    """Every parameter of the model given, once, in its shape (a quantized one ``[N, K]``:
    Phi-3's fused q/k/v and gate/up rows too); one clear line otherwise."""
    given = {**dense, **quant}
    missing = sorted(set(expected) - set(given))
    if missing:
        raise ValueError(f"model: {path.name} lacks weights for {missing[:4]}")
    for name, tensor in given.items():
        if name not in expected:
            raise ValueError(f"model: {path.name} has {name}, which this model does not have")
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"model: {name} has shape {tuple(tensor.shape)} in {path.name}, expected {want}"
            )
