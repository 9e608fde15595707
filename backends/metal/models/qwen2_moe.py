"""Qwen 2 MoE (`qwen2_moe`, Qwen1.5-MoE): Qwen 2's attention (q/k/v biases) with a sparse MLP:
the top `num_experts_per_tok` of `num_experts` SwiGLU experts, weighted by the router's softmax
(renormalised only when `norm_topk_prob`), plus a shared expert scaled by a sigmoid gate.
Per-expert HF tensors are stacked on load as for Qwen 3 MoE."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import pymlxc.core as mx
from pymlxc.core import Array

from .. import nn
from . import llama, qwen2
from .qwen3_moe import ExpertLayers, stack_experts
from .switch_layers import SwitchGLU


@dataclass
class ModelArgs(qwen2.ModelArgs, ExpertLayers):
    model_type: str = "qwen2_moe"
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_experts()


class SharedExpertArgs(Protocol):
    """The ModelArgs fields a MoE block with a shared expert reads (Qwen 2 MoE, Qwen3-Next)."""

    hidden_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool


class SparseMoeBlock(nn.Module):
    def __init__(self, args: SharedExpertArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(dim, args.num_experts)
        self.switch_mlp = SwitchGLU(dim, args.moe_intermediate_size, args.num_experts)
        self.shared_expert = llama.MLP(dim, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(dim, 1)

    def __call__(self, x: Array) -> Array:
        gates = mx.softmax(self.gate(x), axis=-1, precise=True)
        k = self.top_k
        # mlx-lm's order of the k (the partition of -gates), so that sums agree bit for bit.
        inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        y = mx.sum(self.switch_mlp(x, inds) * mx.expand_dims(scores, -1), axis=-2)
        return y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Model(llama.Model):
    segmented_decode = False  # MoE blocks: the whole-step graph decodes them
    args: ModelArgs

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, qwen2.Attention)
        for i, layer in enumerate(self.layers):
            if args.is_moe_layer(i):
                layer.mlp = SparseMoeBlock(args)

    def sanitize(self, weights: dict[str, Array]) -> dict[str, Array]:
        weights = super().sanitize(weights)
        return stack_experts(weights, self.args.num_hidden_layers, self.args.num_experts)
