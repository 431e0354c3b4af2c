"""Which decoder class computes each supported ``model_type``.

One module per family, each over Llama's pieces (``llama.py``) and the shared
building blocks (``blocks.py``); :data:`SUPPORTED_MODEL_TYPES` in ``config.py`` is the
list a refused ``config.json`` is told, and every name in it has a class here.
"""

from __future__ import annotations

from tokenrelay.engine.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from tokenrelay.engine.models.gemma import GemmaForCausalLM
from tokenrelay.engine.models.granite import GraniteForCausalLM
from tokenrelay.engine.models.llama import CausalLM
from tokenrelay.engine.models.olmo2 import Olmo2ForCausalLM
from tokenrelay.engine.models.phi3 import Phi3ForCausalLM

FAMILIES: dict[str, type[CausalLM]] = {
    "llama": CausalLM,
    "mistral": CausalLM,
    "qwen2": CausalLM,
    "qwen3": CausalLM,
    "granite": GraniteForCausalLM,
    "olmo2": Olmo2ForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
    "phi3": Phi3ForCausalLM,
}
assert set(FAMILIES) == set(SUPPORTED_MODEL_TYPES)


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    """The :class:`CausalLM` (sub)class for ``cfg.model_type``."""
    try:
        return FAMILIES[cfg.model_type]
    except KeyError:
        raise ValueError(
            f"model_type: {cfg.model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        ) from None
