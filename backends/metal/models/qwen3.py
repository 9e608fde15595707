"""Qwen 3 (dense): the Llama skeleton with an RMSNorm over each head of q and k before RoPE, and an
explicit `head_dim` (not hidden / heads)."""
from __future__ import annotations

from dataclasses import dataclass

from pymlxc.core import Array

from .. import nn
from . import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    model_type: str = "qwen3"
    rope_theta: float = 1000000.0

    def layer_windows(self) -> list[int | None]:
        return [None] * self.num_hidden_layers


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)

    def normalize_qk(self, q: Array, k: Array) -> tuple[Array, Array]:
        return self.q_norm(q), self.k_norm(k)

    def qk_norms(self) -> tuple[nn.Module, ...]:
        return self.q_norm, self.k_norm


class Model(llama.Model):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention)
