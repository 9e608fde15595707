"""The architectures of the native backend, registered explicitly by HF `model_type`.

Each module exports `ModelArgs` (a dataclass with `from_dict`) and `Model`:
`Model(args)(inputs [B, L] int32, cache=None, mask=None) -> logits [B, L, vocab]`,
`make_cache(context_len)`, `sanitize(weights)`, `layers`, `args`.
"""
from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

from . import gemma2, gemma3, gemma4, llama, qwen2, qwen2_moe, qwen3, qwen3_5, qwen3_5_moe, qwen3_moe, qwen3_next

MODEL_TYPES: dict[str, ModuleType] = {
    "llama": llama,
    "mistral": llama,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "gemma2": gemma2,
    "gemma3_text": gemma3,
    "gemma3": gemma3,
    "qwen2_moe": qwen2_moe,
    "qwen3_moe": qwen3_moe,
    "gemma4_text": gemma4,
    "gemma4": gemma4,
    "qwen3_next": qwen3_next,
    "qwen3_5": qwen3_5,
    "qwen3_5_moe": qwen3_5_moe,
}


class UnsupportedModelError(ValueError):
    """The checkpoint's `model_type` has no architecture here; the message lists those that do."""


def supported_model_types() -> list[str]:
    return sorted(MODEL_TYPES)


ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma4ForCausalLM": "gemma4_text",
    "Gemma4ForConditionalGeneration": "gemma4",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
}


def infer_model_type(config: dict[str, Any], weight_names: Iterable[str] = ()) -> str | None:
    """The model_type of a config that lacks one: Qwen 3 if the weights have a per-head `q_norm`
    (the only way to tell it from Qwen 2), else from `architectures`, else Qwen 2 if the q
    projection has a bias."""
    names = list(weight_names)
    if any(n.endswith("self_attn.q_norm.weight") for n in names):
        return "qwen3"
    for arch in config.get("architectures") or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if any(n.endswith("self_attn.q_proj.bias") for n in names):
        return "qwen2"
    return None


def get_model_module(model_type: str | None, weight_names: Iterable[str] | None = None) -> ModuleType:
    """The architecture module for `model_type`; with none, it is inferred from the weight names
    (see `infer_model_type`). Unknown types raise UnsupportedModelError listing the supported ones."""
    if not model_type:
        model_type = infer_model_type({}, weight_names or ())
        if model_type is None:
            raise UnsupportedModelError(
                "config.json has no model_type and the weights do not identify the architecture; "
                f"supported model types: {', '.join(supported_model_types())}")
    module = MODEL_TYPES.get(model_type)
    if module is None:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; supported model types: {', '.join(supported_model_types())}")
    return module


__all__ = ["MODEL_TYPES", "ARCHITECTURES", "UnsupportedModelError", "get_model_module", "infer_model_type",
           "supported_model_types"]
