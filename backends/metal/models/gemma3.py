"""Gemma 3 text (`gemma3_text`, and the language model inside the multimodal `gemma3`): Gemma 2's
block (four (1 + w) norms, GELU-tanh MLP, scaled embeddings) with an RMSNorm over each q/k head,
no soft-capping, and a 5:1 mix of sliding-window layers (RoPE base `rope_local_base_freq`) and
global layers (RoPE base `rope_theta`, with the checkpoint's `rope_scaling`)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array

from .. import nn
from ..cache import Cache, Mask
from .base import (
    BaseModelArgs,
    LayerMasks,
    TiedHead,
    after_layer,
    attention,
    drop_keys,
    initialize_rope,
    last_query,
    make_layer_caches,
    rope_and_cache,
    softcap,
    softcapped_attention,
)

_reshape = mx.reshape
_transpose = mx.transpose


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are HF's Gemma3TextConfig: the multimodal checkpoints leave many of them out.
    model_type: str = "gemma3_text"
    hidden_size: int = 2304
    num_hidden_layers: int = 26
    intermediate_size: int = 9216
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    vocab_size: int = 262208
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    query_pre_attn_scalar: float = 256
    sliding_window: int = 4096
    sliding_window_pattern: int = 6
    layer_types: list[str] | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool | None = None

    @classmethod
    def from_dict(cls, params: Mapping[str, Any], prefix: str = "") -> ModelArgs:
        """Also takes the multimodal config: the text model's fields are under `text_config`."""
        if isinstance(params.get("text_config"), Mapping):
            text = dict(params["text_config"])
            if params.get("vocab_size") is not None:
                text["vocab_size"] = params["vocab_size"]
            text.setdefault("model_type", "gemma3_text")
            params, prefix = text, prefix + "text_config."
        return super().from_dict(params, prefix)

    def __post_init__(self) -> None:
        rp = self.rope_parameters
        if rp:  # transformers >= 5: {"full_attention": {...}, "sliding_attention": {...}}
            full, local = rp.get("full_attention", rp), rp.get("sliding_attention", {})
            self.rope_theta = full.get("rope_theta", self.rope_theta)
            self.rope_local_base_freq = local.get("rope_theta", self.rope_local_base_freq)
            if self.rope_scaling is None and full.get("rope_type", "default") != "default":
                self.rope_scaling = full

    def layer_windows(self) -> list[int | None]:
        if self.layer_types is not None:
            return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]
        p = self.sliding_window_pattern
        return [None if (i + 1) % p == 0 else self.sliding_window for i in range(self.num_hidden_layers)]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, sliding: bool) -> None:
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.head_dim
        self.scale = float(args.query_pre_attn_scalar) ** -0.5
        self.cap = args.attn_logit_softcapping
        self.q_proj = nn.Linear(dim, n_heads * head_dim)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim)
        self.o_proj = nn.Linear(n_heads * head_dim, dim)
        self.q_norm = nn.OffsetRMSNorm(head_dim, args.rms_norm_eps)
        self.k_norm = nn.OffsetRMSNorm(head_dim, args.rms_norm_eps)
        if sliding:
            self.rope = initialize_rope(head_dim, args.rope_local_base_freq)
        else:
            self.rope = initialize_rope(head_dim, args.rope_theta, scaling=args.rope_scaling)

    def __call__(self, x: Array, mask: Mask, cache: Cache | None, last_only: bool = False) -> Array:
        """`last_only`: every position's keys and values into `cache`, the last query's output alone."""
        b, L, _ = x.shape
        q = self.q_norm(_transpose(_reshape(self.q_proj(x), (b, L, self.n_heads, self.head_dim)), (0, 2, 1, 3)))
        k = self.k_norm(_transpose(_reshape(self.k_proj(x), (b, L, self.n_kv_heads, self.head_dim)), (0, 2, 1, 3)))
        v = _transpose(_reshape(self.v_proj(x), (b, L, self.n_kv_heads, self.head_dim)), (0, 2, 1, 3))
        q, k, v = rope_and_cache(self.rope, q, k, v, cache)
        if last_only:
            (q, mask), L = last_query(q, mask), 1
        if self.cap:
            out = softcapped_attention(q, k, v, scale=self.scale, cap=self.cap, mask=mask, n_kv_heads=self.n_kv_heads)
        else:
            out = attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(_reshape(_transpose(out, (0, 2, 1, 3)), (b, L, -1)))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim)
        self.down_proj = nn.Linear(hidden_dim, dim)
        self.up_proj = nn.Linear(dim, hidden_dim)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


_F16_MAX = 65504.0


def _residual(x: Array, y: Array) -> Array:
    """x + y; in float16 the sum is formed in float32 and clipped, as Gemma 3's activations can
    exceed float16's range."""
    if x.dtype != mx.float16:
        return x + y
    s = mx.astype(x, mx.float32) + mx.astype(y, mx.float32)
    return mx.astype(mx.clip(s, -_F16_MAX, _F16_MAX), mx.float16)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, sliding: bool) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, sliding)
        self.mlp = MLP(dim, args.intermediate_size)
        self.input_layernorm = nn.OffsetRMSNorm(dim, eps)
        self.post_attention_layernorm = nn.OffsetRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = nn.OffsetRMSNorm(dim, eps)
        self.post_feedforward_layernorm = nn.OffsetRMSNorm(dim, eps)

    def __call__(self, x: Array, mask: Mask, cache: Cache | None, last_only: bool = False) -> Array:
        """`last_only`: as `Attention`, and the rest of the block on the last position alone."""
        r = self.self_attn(self.input_layernorm(x), mask, cache, last_only)
        h = _residual(x[:, -1:] if last_only else x, self.post_attention_layernorm(r))
        return _residual(h, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))))


class Gemma3Model(nn.Module):
    def __init__(self, args: ModelArgs, windows: list[int | None]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, w is not None) for w in windows]
        self.norm = nn.OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(TiedHead, nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self._windows = args.layer_windows()
        self.model = Gemma3Model(args, self._windows)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size)
        self._masks = LayerMasks(self._windows)
        self._final_cap = args.final_logit_softcapping
        # sqrt(hidden) rounded to bfloat16 (the checkpoints' dtype), then cast to the activations'.
        self._embed_scale = float(mx.array(args.hidden_size**0.5, mx.bfloat16).item())

    @property
    def layers(self) -> list[TransformerBlock]:
        return self.model.layers

    def __call__(self, inputs: Array, cache: list[Cache] | None = None, mask: Array | None = None, *,
                 last_only: bool = False) -> Array:
        inner = self.model
        h = inner.embed_tokens(inputs) * self._embed_scale
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
        h = inner.norm(h)
        head = self.lm_head
        out = inner.embed_tokens.as_linear(h) if head is None else head(h)
        return softcap(out, self._final_cap) if self._final_cap else out

    def make_cache(self, context_len: int | None = None) -> list[Cache]:
        return make_layer_caches(self._windows, context_len)

    def sanitize(self, weights: dict[str, Array]) -> dict[str, Array]:
        # The multimodal checkpoint's vision tower and projector are not used by the text model.
        weights = drop_keys(weights, "self_attn.rotary_emb.inv_freq")
        weights = {k: v for k, v in weights.items()
                   if not k.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                                        "model.multi_modal_projector."))}
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights
