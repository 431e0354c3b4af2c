"""Microsoft's Phi-3, Phi-3.5 and Phi-4 (``model_type`` ``phi3``): Llama's layer, with what
differs carried by the checkpoint and the config rather than by the layer.

As transformers' ``modeling_phi3.py``, a layer is Llama's: pre-norm RMSNorm, GQA
attention with ``1 / sqrt(head_dim)``, a SwiGLU MLP, residual adds. The differences:

- the checkpoint holds q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``
  (gate first), the layout our projections use: ``weights.py`` maps them as they are
  (under tensor parallelism ``sharding.py`` cuts them section by section: each rank's
  q, k, v rows and gate, up rows);
- ``partial_rotary_factor`` (Phi-4-mini: 0.75) rotates only the first part of each
  head, and ``longrope`` (``su``: Phi-3-*-128k, Phi-3.5, Phi-4-mini) divides the
  frequencies by per-dimension factors and scales cos/sin: both in ``rope.py``, for every
  family (how the engine picks the short or the long factors is said there);
- ``sliding_window`` (Phi-3-mini-4k: 2047) applies to every layer, as transformers'
  sliding-window mask does: each query sees its last ``sliding_window`` keys
  (``ModelConfig.layer_windows``, honoured by every attention backend).

A quantized GGUF runs through the fused C step as Llama's does (partial rotary and
the window are data there); tensor parallelism splits it as it splits Llama.
"""

from __future__ import annotations

from tokenrelay.engine.models.llama import CausalLM, DecoderLayer


class Phi3ForCausalLM(CausalLM):
    """Phi-3: Llama's decoder layer; its rotary variants come from the config."""

    layer_class = DecoderLayer
