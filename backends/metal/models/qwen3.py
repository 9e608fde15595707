"""Qwen 3 (dense): the Llama skeleton with an RMSNorm over each head of q and k before RoPE, and an
explicit `head_dim` (not hidden / heads)."""
from __future__ import annotations

from dataclasses import dataclass

import pymlxc.core as mx
from pymlxc.core import Array

from .. import nn
from ..cache import Cache, Mask
from . import llama

_reshape = mx.reshape
_transpose = mx.transpose


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

    def __call__(self, x: Array, mask: Mask, cache: Cache | None, last_only: bool = False) -> Array:
        b, L, _ = x.shape
        q = _transpose(self.q_norm(_reshape(self.q_proj(x), (b, L, self.n_heads, self.head_dim))), (0, 2, 1, 3))
        k = _transpose(self.k_norm(_reshape(self.k_proj(x), (b, L, self.n_kv_heads, self.head_dim))), (0, 2, 1, 3))
        v = _transpose(_reshape(self.v_proj(x), (b, L, self.n_kv_heads, self.head_dim)), (0, 2, 1, 3))
        return self.attend(q, k, v, mask, cache, last_only)


class Model(llama.Model):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention)
