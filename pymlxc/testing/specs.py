"""One spec per architecture the tiny writer knows: adding an architecture adds one entry to SPECS
(and, for a new kind of block, its config fields and tensors beside the others)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import tokenizer as tok
from .gemma4 import gemma4_config, gemma4_weights
from .moe import moe_config, quantize_switch
from .quantize import quantize_dense
from .qwen_next import next_config, next_multimodal_config, next_weights, quantize_next
from .transformer import gemma2_fields, gemma3_fields, llama_fields, qwen_fields, tensors

# (arch, num_layers=, head_dim=, vocab_size=, rope_scaling=) -> the family's config.json fields
Fields = Callable[..., dict[str, Any]]
# (text config, spec, rng) -> float64 tensors in the text model's HF names
Weights = Callable[[Mapping[str, Any], "ArchSpec", np.random.Generator], dict[str, np.ndarray]]
# (weights, arch, group_size, bits) -> (quantized weights, per-layer quantization overrides)
Quantize = Callable[[dict[str, np.ndarray], str, int, int], tuple[dict[str, np.ndarray], dict[str, Any]]]
# (arch, text config, token ids, dtype) -> the outer config of a multimodal checkpoint
Outer = Callable[[str, dict[str, Any], Mapping[str, Any], str], dict[str, Any]]


def linear_of(rng: np.random.Generator) -> Callable[[int, int], np.ndarray]:
    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        # std 1/sqrt(fan_in) keeps activations O(1), so logits are finite but not all alike.
        return rng.normal(0.0, in_dim**-0.5, size=(out_dim, in_dim))
    return linear


def block_weights(config: Mapping[str, Any], spec: ArchSpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The standard block's tensors (`transformer.tensors`), drawn in order."""
    w: dict[str, np.ndarray] = {}
    for name, shape, kind in tensors(config, spec):
        if kind == "norm":
            w[name] = rng.normal(spec.norm_center, 0.05, size=shape)
        elif kind == "bias":
            w[name] = rng.normal(0.0, 0.02, size=shape)
        else:  # linear or embedding: std 1/sqrt(fan_in)
            w[name] = rng.normal(0.0, shape[-1] ** -0.5, size=shape)
    return w


def _embedding(config: Mapping[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    hidden = config["hidden_size"]
    return {"model.embed_tokens.weight": rng.normal(0.0, hidden**-0.5, size=(config["vocab_size"], hidden))}


def _gemma4_weights(config: Mapping[str, Any], spec: ArchSpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return gemma4_weights(config, spec.name, _embedding(config, rng), linear_of(rng), rng)


def _next_weights(config: Mapping[str, Any], spec: ArchSpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return next_weights(config, spec.name, _embedding(config, rng), linear_of(rng), rng)


def _moe_fields(arch: str, *, num_layers: int, **_: Any) -> dict[str, Any]:
    return moe_config(arch, num_layers=num_layers)


def _gemma4_fields(arch: str, *, num_layers: int, head_dim: int, vocab_size: int, **_: Any) -> dict[str, Any]:
    return gemma4_config(arch, num_layers=num_layers, head_dim=head_dim, vocab_size=vocab_size)


def _next_fields(arch: str, *, num_layers: int, **_: Any) -> dict[str, Any]:
    return next_config(arch, num_layers=num_layers)


def _conditional_generation(arch: str, text: dict[str, Any], ids: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """Gemma 3's and Gemma 4's multimodal checkpoints: the text model's config under `text_config`."""
    text_only = {k: v for k, v in text.items() if k != "architectures"}
    config: dict[str, Any] = {
        "architectures": [f"{arch.capitalize()}ForConditionalGeneration"], "model_type": arch,
        "text_config": text_only, "vocab_size": text["vocab_size"], "tie_word_embeddings": text["tie_word_embeddings"],
        "torch_dtype": dtype, **ids,
    }
    if arch == "gemma4":
        config["vision_config"] = {"model_type": "gemma4_vision", "hidden_size": 16, "num_hidden_layers": 1}
    return config


def _same(name: str) -> str:
    return name


def _under_language_model(name: str) -> str:  # Qwen 3.5: model.X -> model.language_model.X
    if name.startswith("model.") and not name.startswith("model.visual."):
        return "model.language_model." + name[len("model."):]
    return name


def _gemma3_nested(name: str) -> str:
    return "language_model." + name


def _gemma4_nested(name: str) -> str:
    if name.startswith("model.") and not name.startswith(("model.vision", "model.embed_vision")):
        return "model.language_model." + name[len("model."):]
    return name


@dataclass(frozen=True)
class ArchSpec:
    """How a tiny checkpoint of one architecture is written."""

    name: str  # the `arch` argument, and config.json's model_type
    tokens: tok.TokenFamily
    fields: Fields
    weights: Weights = block_weights
    quantize: Quantize = quantize_dense
    outer: Outer | None = None  # the multimodal wrapper of the text config
    rename: Callable[[str], str] = _same  # a text-model tensor's name in the checkpoint
    text_model_type: str | None = None  # the nested text config's model_type, where it differs
    tied: bool = True  # the family's usual tie_word_embeddings
    always_tied: bool = False
    layers: int = 2  # the default num_layers
    # The standard block's options (block_weights):
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False
    sandwich_norms: bool = False  # Gemma's norms before and after the MLP
    norm_center: float = 1.0  # 0 where the RMSNorm scales by (1 + w)


_SPECS = (
    ArchSpec("llama", tok.LLAMA3, llama_fields, tied=False),
    ArchSpec("mistral", tok.MISTRAL, llama_fields, tied=False),
    ArchSpec("qwen2", tok.QWEN, qwen_fields, qkv_bias=True),
    ArchSpec("qwen3", tok.QWEN3, qwen_fields, qk_norm=True),
    ArchSpec("gemma2", tok.GEMMA, gemma2_fields, always_tied=True, sandwich_norms=True, norm_center=0.0),
    ArchSpec("gemma3_text", tok.GEMMA, gemma3_fields, qk_norm=True, sandwich_norms=True, norm_center=0.0),
    ArchSpec("gemma3", tok.GEMMA, gemma3_fields, outer=_conditional_generation, rename=_gemma3_nested,
             text_model_type="gemma3_text", qk_norm=True, sandwich_norms=True, norm_center=0.0),
    ArchSpec("qwen2_moe", tok.QWEN, _moe_fields, quantize=quantize_switch, tied=False, qkv_bias=True, moe=True),
    ArchSpec("qwen3_moe", tok.QWEN3, _moe_fields, quantize=quantize_switch, tied=False, qk_norm=True, moe=True),
    ArchSpec("gemma4_text", tok.GEMMA, _gemma4_fields, _gemma4_weights, quantize_switch, layers=4),
    ArchSpec("gemma4", tok.GEMMA, _gemma4_fields, _gemma4_weights, quantize_switch, outer=_conditional_generation,
             rename=_gemma4_nested, text_model_type="gemma4_text"),
    ArchSpec("qwen3_next", tok.QWEN3, _next_fields, _next_weights, quantize_next, tied=False, layers=4),
    ArchSpec("qwen3_5", tok.QWEN35, _next_fields, _next_weights, quantize_next, outer=next_multimodal_config,
             rename=_under_language_model, layers=4),
    ArchSpec("qwen3_5_moe", tok.QWEN35, _next_fields, _next_weights, quantize_next, outer=next_multimodal_config,
             rename=_under_language_model, tied=False, layers=4),
)
SPECS: dict[str, ArchSpec] = {s.name: s for s in _SPECS}


def spec_of(arch: str) -> ArchSpec:
    if arch not in SPECS:
        raise ValueError(f"unknown architecture {arch!r}; supported: {', '.join(SPECS)}")
    return SPECS[arch]


__all__ = ["SPECS", "ArchSpec", "block_weights", "linear_of", "spec_of"]
