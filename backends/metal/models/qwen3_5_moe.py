"""Qwen 3.5 MoE (`qwen3_5_moe`, e.g. Qwen3.5-35B-A3B): Qwen 3.5 with a sparse MoE block (router,
top-k experts, gated shared expert) in every layer. HF checkpoints fuse each layer's experts into
`mlp.experts.gate_up_proj` [E, 2 * moe_intermediate_size, hidden] and `mlp.experts.down_proj`,
split on load (`qwen3_5.split_gate_up`); mlx-lm's quantized checkpoints have `switch_mlp` already,
with the routers (`mlp.gate`, `mlp.shared_expert_gate`) at their own 8 bits."""
from __future__ import annotations

from dataclasses import dataclass

from . import qwen3_5


@dataclass
class ModelArgs(qwen3_5.ModelArgs):
    model_type: str = "qwen3_5_moe"


class Model(qwen3_5.Model):
    pass


__all__ = ["ModelArgs", "Model"]
