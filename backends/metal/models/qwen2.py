"""Qwen 2 / 2.5: the Llama skeleton with biases on the q, k and v projections (not on o)."""
from __future__ import annotations

from dataclasses import dataclass

from .. import nn
from . import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    model_type: str = "qwen2"
    rope_theta: float = 1000000.0

    def __post_init__(self) -> None:
        # Qwen 2 configs carry no head_dim; the head size is always hidden / heads.
        self.head_dim = self.hidden_size // self.num_attention_heads
        super().__post_init__()

    def layer_windows(self) -> list[int | None]:
        # `use_sliding_window` is off in every released Qwen 2 checkpoint; attention is full.
        return [None] * self.num_hidden_layers


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        dim, hd = args.hidden_size, self.head_dim
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=True)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=True)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=True)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)


class Model(llama.Model):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention)
