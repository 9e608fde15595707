"""Qwen 3.5 (`qwen3_5`, dense MLPs or, with `num_experts`, MoE in every layer): Qwen3-Next's blocks
with the linear layers' projections apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`),
norm_topk_prob on by default and RoPE settings under `rope_parameters` (theta, the rotary fraction;
the multimodal sections are for images and change nothing for text).

The checkpoints are multimodal (`Qwen3_5ForConditionalGeneration`): the text model's fields are
under `text_config`, its tensors under `model.language_model.` (HF) or `language_model.model.`
(mlx-lm), which the loader maps to `model.`; the vision tower (`model.visual.`, `vision_tower.`)
is dropped.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array

from .. import nn
from ..config_check import ConfigError
from . import qwen3_next

_reshape = mx.reshape
TOWERS = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.")


@dataclass
class ModelArgs(qwen3_next.ModelArgs):
    model_type: str = "qwen3_5"
    num_key_value_heads: int = 8
    rope_theta: float = 100000.0
    linear_num_value_heads: int = 64
    linear_num_key_heads: int = 16
    linear_key_head_dim: int = 192
    linear_value_head_dim: int = 128
    norm_topk_prob: bool = True

    @classmethod
    def from_dict(cls, params: Mapping[str, Any], prefix: str = "") -> ModelArgs:
        """Also takes the multimodal config: the text model's fields under `text_config` (with
        the top level's tie_word_embeddings where the text part has none)."""
        text = params.get("text_config")
        if text is not None:
            if not isinstance(text, Mapping):
                raise ConfigError(f"{prefix}text_config: expected an object, got {type(text).__name__}")
            merged = dict(text)
            if "tie_word_embeddings" not in merged and "tie_word_embeddings" in params:
                merged["tie_word_embeddings"] = params["tie_word_embeddings"]
            merged["model_type"] = params.get("model_type") or merged.get("model_type")
            params, prefix = merged, prefix + "text_config."
        try:
            return super().from_dict(params, prefix)
        except ConfigError as exc:  # the checks between fields name them without the nesting
            if prefix and not str(exc).startswith(prefix):
                raise ConfigError(f"{prefix}{exc}") from None
            raise

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0  # every layer, as mlx-lm builds it


class GatedDeltaNet(qwen3_next.GatedDeltaNet):
    def make_projections(self, args: qwen3_next.ModelArgs) -> None:
        dim = args.hidden_size
        self.in_proj_qkv = nn.Linear(dim, self.key_dim * 2 + self.value_dim)
        self.in_proj_z = nn.Linear(dim, self.value_dim)
        self.in_proj_b = nn.Linear(dim, self.num_v_heads)
        self.in_proj_a = nn.Linear(dim, self.num_v_heads)

    def project(self, x: Array) -> tuple[Array, Array, Array, Array]:
        b, s, _ = x.shape
        z = _reshape(self.in_proj_z(x), (b, s, self.num_v_heads, self.head_v_dim))
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


class Model(qwen3_next.Model):
    linear_cls = GatedDeltaNet

    def sanitize(self, weights: dict[str, Array]) -> dict[str, Array]:
        weights = {k: v for k, v in weights.items() if not k.startswith(TOWERS)}
        return super().sanitize(split_gate_up(weights, self.args.num_hidden_layers))


def split_gate_up(weights: dict[str, Array], num_layers: int) -> dict[str, Array]:
    """HF's fused experts `mlp.experts.gate_up_proj` [E, 2 * inter, hidden] and `mlp.experts.down_proj`
    -> mlx-lm's `mlp.switch_mlp.{gate,up,down}_proj.weight`."""
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.mlp"
        fused = weights.pop(f"{prefix}.experts.gate_up_proj", None)
        if fused is None:
            continue
        down = weights.pop(f"{prefix}.experts.down_proj", None)
        if down is None:
            raise nn.WeightsError(f"missing tensor in checkpoint: {prefix}.experts.down_proj "
                                  f"(beside {prefix}.experts.gate_up_proj)")
        if fused.ndim != 3 or fused.shape[-2] % 2:
            raise nn.WeightsError(f"tensor {prefix}.experts.gate_up_proj: expected [experts, 2 * size, hidden], "
                                  f"got {tuple(fused.shape)}")
        mid = fused.shape[-2] // 2
        weights[f"{prefix}.switch_mlp.gate_proj.weight"] = fused[..., :mid, :]
        weights[f"{prefix}.switch_mlp.up_proj.weight"] = fused[..., mid:, :]
        weights[f"{prefix}.switch_mlp.down_proj.weight"] = down
    return weights


__all__ = ["ModelArgs", "Model", "GatedDeltaNet", "split_gate_up"]
