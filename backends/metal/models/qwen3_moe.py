"""Qwen 3 MoE (`qwen3_moe`): Qwen 3's attention (per-head q/k RMSNorm) with a sparse MLP in the
layers that `decoder_sparse_step` / `mlp_only_layers` pick: a softmax router over `num_experts`,
the top `num_experts_per_tok` experts (renormalised when `norm_topk_prob`) through stacked SwiGLU
experts. Like mlx-lm, RoPE is plain (`rope_scaling` is not applied).

HF checkpoints store each expert apart (`mlp.experts.3.up_proj.weight`); `sanitize` stacks them
into mlx-lm's switch layout (`mlp.switch_mlp.up_proj.weight` [E, out, in]), which quantized
checkpoints already use.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pymlxc.core as mx
from pymlxc.core import Array

from .. import nn
from ..config_check import ConfigError
from . import llama, qwen3
from .switch_layers import SwitchGLU


class ExpertLayers:
    """What the MoE ModelArgs share (Qwen 2 MoE, Qwen 3 MoE, Qwen3-Next): the router's k checked
    against the experts, and which layers are sparse. A mixin: each dataclass declares the fields."""

    num_experts: int
    num_experts_per_tok: int
    decoder_sparse_step: int
    mlp_only_layers: list[int]

    def check_experts(self) -> None:
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok must be in 1..{self.num_experts}, got {self.num_experts_per_tok}")

    def is_moe_layer(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % max(self.decoder_sparse_step, 1) == 0)


@dataclass
class ModelArgs(qwen3.ModelArgs, ExpertLayers):
    model_type: str = "qwen3_moe"
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.rope_scaling = None  # mlx-lm's qwen3_moe rotates with the plain base
        self.check_experts()


def top_k_routing(gates: Array, k: int, *, normalize: bool) -> tuple[Array, Array]:
    """Indices [..., k] of the k largest router probabilities and their weights (renormalised to
    sum to 1 when `normalize`). The order within the k is argpartition's, as in mlx-lm."""
    inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if normalize:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    return inds, scores


def combine(y: Array, scores: Array) -> Array:
    """The experts' outputs y [..., k, D] weighted by their scores [..., k] and summed."""
    return mx.astype(mx.sum(y * mx.expand_dims(scores, -1), axis=-2), y.dtype)


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(dim, args.num_experts)
        self.switch_mlp = SwitchGLU(dim, args.moe_intermediate_size, args.num_experts)

    def __call__(self, x: Array) -> Array:
        gates = mx.softmax(self.gate(x), axis=-1, precise=True)
        inds, scores = top_k_routing(gates, self.top_k, normalize=self.norm_topk_prob)
        return combine(self.switch_mlp(x, inds), scores)


def stack_experts(weights: dict[str, Array], num_layers: int, num_experts: int) -> dict[str, Array]:
    """HF's per-expert tensors `model.layers.L.mlp.experts.E.P.{weight,scales,biases}` -> one
    [E, ...] tensor `model.layers.L.mlp.switch_mlp.P.*` per layer and projection."""
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.mlp"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for kind in ("weight", "scales", "biases", "bias"):
                if f"{prefix}.experts.0.{proj}.{kind}" not in weights:
                    continue
                names = [f"{prefix}.experts.{e}.{proj}.{kind}" for e in range(num_experts)]
                missing = [n for n in names if n not in weights]
                if missing:
                    raise nn.WeightsError(f"missing tensor{'s' if len(missing) > 1 else ''} in checkpoint: "
                                          + ", ".join(missing[:10]))
                weights[f"{prefix}.switch_mlp.{proj}.{kind}"] = mx.stack([weights.pop(n) for n in names])
    return weights


class Model(llama.Model):
    segmented_decode = False  # MoE blocks: the whole-step graph decodes them
    args: ModelArgs

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, qwen3.Attention)
        for i, layer in enumerate(self.layers):
            if args.is_moe_layer(i):
                layer.mlp = SparseMoeBlock(args)

    def sanitize(self, weights: dict[str, Array]) -> dict[str, Array]:
        weights = super().sanitize(weights)
        return stack_experts(weights, self.args.num_hidden_layers, self.args.num_experts)
