"""Gemma 2: four (1 + w) RMSNorms per block (around attention and MLP), GELU-tanh gated MLP, scores
scaled by `query_pre_attn_scalar`^-1/2 and soft-capped, alternating sliding-window / global layers,
embeddings scaled by sqrt(hidden), tied output head with final logit soft-capping."""
from __future__ import annotations

from dataclasses import dataclass

import pymlxc.core as mx
from pymlxc.core import Array

from .. import nn
from ..cache import Cache, Mask
from .base import (
    BaseModelArgs,
    LayerMasks,
    RoPE,
    TiedHead,
    after_layer,
    attention,
    drop_keys,
    last_query,
    make_layer_caches,
    resolved,
    rope_and_cache,
    softcap,
    softcapped_attention,
)

_reshape = mx.reshape
_transpose = mx.transpose


@dataclass
class ModelArgs(BaseModelArgs):
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    model_type: str = "gemma2"
    head_dim: int | None = 256  # HF's default; not hidden / heads (null: hidden / heads)
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0
    query_pre_attn_scalar: float | None = None  # None: head_dim
    sliding_window: int | None = 4096
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.query_pre_attn_scalar is None:
            self.query_pre_attn_scalar = self.head_dim

    def layer_windows(self) -> list[int | None]:
        """Even layers look back `sliding_window` tokens, odd layers see everything."""
        types = self.layer_types or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                     for i in range(self.num_hidden_layers)]
        return [self.sliding_window if t == "sliding_attention" and self.sliding_window else None for t in types]


class Attention(nn.Module):
    prefill_kernel = False  # a causal chunk's attention through pymlxc's CUDA kernel (nn.mark_prefill_attention)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = resolved(args.num_key_value_heads, "num_key_value_heads")
        self.head_dim = head_dim = resolved(args.head_dim, "head_dim")
        self.scale = float(resolved(args.query_pre_attn_scalar, "query_pre_attn_scalar")) ** -0.5
        self.cap = args.attn_logit_softcapping
        self.q_proj = nn.Linear(dim, n_heads * head_dim)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim)
        self.o_proj = nn.Linear(n_heads * head_dim, dim)
        self.rope = RoPE(head_dim, base=args.rope_theta, traditional=args.rope_traditional)

    def __call__(self, x: Array, mask: Mask, cache: Cache | None, last_only: bool = False) -> Array:
        """`last_only`: every position's keys and values into `cache`, the last query's output alone."""
        b, L, _ = x.shape
        q = _transpose(_reshape(self.q_proj(x), (b, L, self.n_heads, self.head_dim)), (0, 2, 1, 3))
        k = _transpose(_reshape(self.k_proj(x), (b, L, self.n_kv_heads, self.head_dim)), (0, 2, 1, 3))
        v = _transpose(_reshape(self.v_proj(x), (b, L, self.n_kv_heads, self.head_dim)), (0, 2, 1, 3))
        q, k, v = rope_and_cache(self.rope, q, k, v, cache)
        if last_only:
            (q, mask), L = last_query(q, mask), 1
        if self.cap:
            out = softcapped_attention(q, k, v, scale=self.scale, cap=self.cap, mask=mask, n_kv_heads=self.n_kv_heads)
        else:
            out = attention(q, k, v, scale=self.scale, mask=mask, kernel=self.prefill_kernel)
        return self.o_proj(_reshape(_transpose(out, (0, 2, 1, 3)), (b, L, -1)))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim)
        self.down_proj = nn.Linear(hidden_dim, dim)
        self.up_proj = nn.Linear(dim, hidden_dim)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args)
        self.mlp = MLP(dim, args.intermediate_size)
        self.input_layernorm = nn.OffsetRMSNorm(dim, eps)
        self.post_attention_layernorm = nn.OffsetRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = nn.OffsetRMSNorm(dim, eps)
        self.post_feedforward_layernorm = nn.OffsetRMSNorm(dim, eps)

    def __call__(self, x: Array, mask: Mask, cache: Cache | None, last_only: bool = False) -> Array:
        """`last_only`: as `Attention`, and the rest of the block on the last position alone."""
        r = self.self_attn(self.input_layernorm(x), mask, cache, last_only)
        h = (x[:, -1:] if last_only else x) + self.post_attention_layernorm(r)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(TiedHead, nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = GemmaModel(args)
        self.lm_head = None  # Gemma 2 always ties its output head to the embeddings
        self._embed_scale = args.hidden_size**0.5
        self._final_cap = args.final_logit_softcapping
        self._windows = args.layer_windows()
        self._masks = LayerMasks(self._windows)

    @property
    def layers(self) -> list[TransformerBlock]:
        return self.model.layers

    def __call__(self, inputs: Array, cache: list[Cache] | None = None, mask: Array | None = None, *,
                 last_only: bool = False) -> Array:
        inner = self.model
        h = inner.embed_tokens(inputs) * self._embed_scale  # the scale is rounded to h's dtype, as in HF
        masks = self._masks(inputs.shape[1], cache, mask)
        caches = cache if cache is not None else [None] * len(masks)
        last = len(inner.layers) - 1
        for i, (layer, m, c) in enumerate(zip(inner.layers, masks, caches, strict=False)):
            # The last layer's queries, attention output and MLP on the last position alone.
            h = layer(h, m, c, last_only and i == last)
            after_layer(h, c)
        return self.output(h[:, -1:] if last_only else h)

    def output(self, h: Array) -> Array:
        """Hidden states after the last layer -> logits (the final norm, the head, the softcap)."""
        inner = self.model
        out = inner.embed_tokens.as_linear(inner.norm(h))
        return softcap(out, self._final_cap) if self._final_cap else out

    def make_cache(self, context_len: int | None = None) -> list[Cache]:
        return make_layer_caches(self._windows, context_len)

    def sanitize(self, weights: dict[str, Array]) -> dict[str, Array]:
        weights = drop_keys(weights, "self_attn.rotary_emb.inv_freq")
        return {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
