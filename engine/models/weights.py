"""Load a Hugging Face safetensors checkpoint into its family's :class:`CausalLM`.

Reads a single ``model.safetensors``, a sharded ``model.safetensors.index.json``
or every ``*.safetensors`` in the folder, renames the tensors to our module's
names and fuses q/k/v and gate/up by concatenation (Phi-3's checkpoints hold them fused,
in the same order). fp32 on CPU; bf16 on CUDA (fp16 where the GPU has no bf16) unless
a dtype is given.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from tokenrelay.engine.kernels import cpu_linear
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.families import model_class
from tokenrelay.engine.models.llama import CausalLM
from tokenrelay.engine.parallel.layout import local_config
from tokenrelay.engine.parallel.sharding import shard_state

if TYPE_CHECKING:
    from tokenrelay.engine.models.blocks import Collectives

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# checkpoint name within ``model.layers.N.`` -> ours (also the GGUF loader's, gguf_weights.py)
LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_attn_norm.weight",
    "pre_feedforward_layernorm.weight": "pre_ff_norm.weight",  # Gemma
    "post_feedforward_layernorm.weight": "post_ff_norm.weight",  # OLMo 2, Gemma
    "self_attn.o_proj.weight": "attn.o_weight",
    "self_attn.o_proj.bias": "attn.o_bias",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.down_proj.weight": "mlp.down_weight",
    "mlp.down_proj.bias": "mlp.down_bias",
    "self_attn.qkv_proj.weight": "attn.qkv_weight",  # Phi-3: q, k, v fused already
    "mlp.gate_up_proj.weight": "mlp.gate_up_weight",  # Phi-3: gate, then up
}
FUSED = {  # fused name -> parts, in order
    "attn.qkv_weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "attn.qkv_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.gate_up_bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
}


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU; bf16 on CUDA, or fp16 where the GPU lacks bf16."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (sharded index honoured)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {folder}")
    return files


def read_checkpoint(folder: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, under its Hugging Face name, on ``device``."""
    tensors: dict[str, torch.Tensor] = {}
    dev = "cpu" if device.type == "cpu" else str(device)
    for file in checkpoint_files(folder):
        with safe_open(str(file), framework="pt", device=dev) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[name] = f.get_tensor(name)
    return tensors


def load_model(
    folder: Path,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp: Collectives | None = None,
) -> CausalLM:
    """Build ``cfg``'s family (engine/models/families.py) with the checkpoint's weights on
    ``device``.

    ``tp``: this process is one rank of a tensor-parallel group; the model holds only
    this rank's shard of the weights (engine/parallel/sharding.py).
    """
    size = 1 if tp is None else tp.size
    cls = model_class(cfg)
    if size > 1 and not cls.tensor_parallel:
        raise ValueError(f"tensor_parallel_size: model_type {cfg.model_type} runs on one rank only")
    with torch.device("meta"):
        model = cls(local_config(cfg, size))
    hf = read_checkpoint(folder, device)
    state: dict[str, torch.Tensor] = {}
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in hf.items():
        m = _LAYER.match(name)
        if m:
            per_layer.setdefault(int(m.group(1)), {})[m.group(2)] = tensor
        elif name == "model.embed_tokens.weight":
            state["embed"] = tensor
        elif name == "model.norm.weight":
            state["norm.weight"] = tensor
        elif name == "lm_head.weight" and not cfg.tie_word_embeddings:
            state["lm_head"] = tensor
    for i, parts in per_layer.items():
        if i >= cfg.num_layers:
            raise ValueError(
                f"num_hidden_layers: checkpoint has layer {i}, config says {cfg.num_layers}"
            )
        for hf_name, ours in LAYER_NAMES.items():
            if hf_name in parts:
                state[f"layers.{i}.{ours}"] = parts[hf_name]
        for ours, names in FUSED.items():
            if all(n in parts for n in names):
                state[f"layers.{i}.{ours}"] = torch.cat([parts[n] for n in names], dim=0)
    if tp is not None:
        state = shard_state(state, cfg, tp.rank, tp.size)
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"model: checkpoint in {folder} lacks weights for {missing[:4]}")
    for name, tensor in state.items():
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"model: weight {name} has shape {tuple(tensor.shape)}, expected {want}"
            )
        state[name] = tensor.to(device=device, dtype=dtype)
        if tp is not None:  # a column slice is a strided view: the kernels want rows
            state[name] = state[name].contiguous()
    model.load_state_dict(state, strict=True, assign=True)
    if tp is not None:
        model.set_parallel(tp, cfg.vocab_size)
    for p in model.parameters():
        p.requires_grad_(False)
    model.init_rope(device)
    if cpu_linear.packing_available(device, dtype):
        model.pack_linears()
    return model.eval()
