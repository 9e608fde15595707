"""Llama 2/3.x (and Mistral, which has the same checkpoint layout): pre-norm blocks, GQA attention
with RoPE (optionally Llama 3 scaled), SwiGLU MLP, RMSNorm."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

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
    resolved,
    rope_and_cache,
)

_reshape = mx.reshape
_transpose = mx.transpose
AddNorm = Callable[[Array, Array, Any], tuple[Array, Array]]


@dataclass
class ModelArgs(BaseModelArgs):
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    model_type: str = "llama"
    rms_norm_eps: float = 1e-6
    head_dim: int | None = None
    num_key_value_heads: int | None = None
    max_position_embeddings: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    tie_word_embeddings: bool | None = None  # None: tied when the checkpoint has no lm_head
    layer_types: list[str] | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        resolve_rope_parameters(self)

    def layer_windows(self) -> list[int | None]:
        """The sliding window of each layer (None: full attention). Mistral's `sliding_window`
        applies to every layer; `layer_types` picks layers explicitly."""
        n = self.num_hidden_layers
        if self.layer_types is not None:
            return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]
        if self.model_type == "mistral" and self.sliding_window:
            return [self.sliding_window] * n
        return [None] * n


def resolve_rope_parameters(args: Any) -> None:
    """transformers >= 5 nests rope_theta and the scaling under `rope_parameters`."""
    params = args.rope_parameters
    if params:
        if "rope_theta" in params:
            args.rope_theta = params["rope_theta"]
        if args.rope_scaling is None and (params.get("rope_type") or params.get("type", "default")) != "default":
            args.rope_scaling = params


class Attention(nn.Module):
    prefill_kernel = False  # a causal chunk's attention through pymlxc's CUDA kernel (nn.mark_prefill_attention)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = resolved(args.num_key_value_heads, "num_key_value_heads")
        self.head_dim = head_dim = resolved(args.head_dim, "head_dim")
        self.scale = head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.rope = initialize_rope(head_dim, args.rope_theta, args.rope_traditional, args.rope_scaling)

    # The attention in halves, which the segmented decode and prefill (segments.py,
    # decode/prefill.py) call around their own attention step: `heads` before RoPE, `output` after.
    def heads(self, x: Array, qkv: Callable[[Array], Sequence[Array]] | None = None,
              one_token: bool = False) -> tuple[Array, Array, Array]:
        """q, k, v [B, heads, L, D] of `x` [B, L, dim], before RoPE. `qkv`: the three projections as
        one call (fused weights). `one_token` (L = 1): [B, 1, heads * D] is [B, heads, 1, D]
        already, so no transpose goes into a traced graph."""
        b = x.shape[0]
        q, k, v = qkv(x) if qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        if one_token:
            q = _reshape(q, (b, self.n_heads, 1, self.head_dim))
            k = _reshape(k, (b, self.n_kv_heads, 1, self.head_dim))
            return (*self.normalize_qk(q, k), _reshape(v, (b, self.n_kv_heads, 1, self.head_dim)))
        q = _reshape(q, (b, -1, self.n_heads, self.head_dim))
        k = _reshape(k, (b, -1, self.n_kv_heads, self.head_dim))
        q, k = self.normalize_qk(q, k)
        v = _reshape(v, (b, -1, self.n_kv_heads, self.head_dim))
        return _transpose(q, (0, 2, 1, 3)), _transpose(k, (0, 2, 1, 3)), _transpose(v, (0, 2, 1, 3))

    def normalize_qk(self, q: Array, k: Array) -> tuple[Array, Array]:
        """q and k per head before RoPE (over the last axis, so on either layout): none here (Qwen 3 has norms)."""
        return q, k

    def qk_norms(self) -> tuple[nn.Module, ...]:
        """The (q, k) norms `normalize_qk` applies, () where none (fused projections join them)."""
        return ()

    def output(self, out: Array, one_token: bool = False) -> Array:
        """o_proj of the attention's output [B, heads, L, D] -> [B, L, dim]; with `one_token` also
        a kernel's flat [B, 1, heads * D] (`one_token_rows`)."""
        if one_token:
            return self.o_proj(one_token_rows(out))
        b = out.shape[0]
        return self.o_proj(_reshape(_transpose(out, (0, 2, 1, 3)), (b, -1, self.n_heads * out.shape[3])))

    def __call__(self, x: Array, mask: Mask, cache: Cache | None, last_only: bool = False) -> Array:
        return self.attend(*self.heads(x), mask, cache, last_only)

    def attend(self, q: Array, k: Array, v: Array, mask: Mask, cache: Cache | None, last_only: bool) -> Array:
        """RoPE, the cache update and attention of q, k, v [B, heads, L, D], then o_proj. `last_only`:
        every position's keys and values, but the last query's output alone [B, 1, dim]."""
        q, k, v = rope_and_cache(self.rope, q, k, v, cache)
        if last_only:
            q, mask = last_query(q, mask)
        return self.output(attention(q, k, v, scale=self.scale, mask=mask, kernel=self.prefill_kernel))


def one_token_rows(out: Array) -> Array:
    """One token's attention output [B, heads, 1, D] as o_proj takes it, [B, 1, heads * D] (a
    kernel's flat output as it is: a reshape to the same shape would still be a graph node)."""
    return out if out.ndim == 3 else _reshape(out, (out.shape[0], 1, out.shape[1] * out.shape[3]))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)

    def __call__(self, x: Array, gate_up: Callable[[Array], Sequence[Array]] | None = None) -> Array:
        """down(silu(gate(x)) * up(x)); `gate_up`: the two projections as one call (fused weights)."""
        if gate_up is not None:
            # A fused gate/up that computes silu(gate) * up itself (one CUDA kernel, the decode's).
            paired = getattr(gate_up, "silu_product", None)
            product = paired(x) if paired is not None else None
            if product is not None:
                return self.down_proj(product)
        g, u = gate_up(x) if gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(nn.silu(g) * u)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, attention_cls: type[Attention] = Attention) -> None:
        super().__init__()
        self.self_attn = attention_cls(args)
        # MoE subclasses put a block here that takes x alone.
        self.mlp: MLP | Callable[[Array], Array] = MLP(args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: Array, mask: Mask, cache: Cache | None, last_only: bool = False) -> Array:
        """`last_only`: the keys and values of every position go into `cache`, the output is the
        last position's alone [B, 1, dim] (the rest of the block runs on that position only)."""
        h, mlp_out = self.finish(x[:, -1:] if last_only else x,
                                 self.self_attn(self.input_layernorm(x), mask, cache, last_only))
        return h + mlp_out

    def finish(self, x: Array, attn_out: Array, gate_up: Callable[[Array], Sequence[Array]] | None = None,
               add_norm: AddNorm | None = None) -> tuple[Array, Array]:
        """The block after its attention (`attn_out`: o_proj's output): (h, the MLP's output), h =
        x + attn_out; the block's output is their sum, which the caller adds (the segmented decode
        with the next norm). `add_norm(h, out, norm)` -> (h + out, norm(h + out)) in one kernel."""
        if add_norm is not None:
            h, normed = add_norm(x, attn_out, self.post_attention_layernorm)
        else:
            h = x + attn_out
            normed = self.post_attention_layernorm(h)
        mlp = self.mlp
        if gate_up is None:
            return h, mlp(normed)
        if not isinstance(mlp, MLP):  # fused gate/up weights exist for dense blocks only
            raise TypeError(f"fused gate/up projections need a dense MLP, not {type(mlp).__name__}")
        return h, mlp(normed, gate_up)


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, attention_cls: type[Attention] = Attention) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, attention_cls) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(TiedHead, nn.Module):
    """Token ids [B, L] -> logits [B, L, vocab]. Also the base of Qwen 2/3 (same skeleton)."""

    # The segmented decode and prefill (segments.py) run this model's blocks in halves
    # (`Attention.heads` / `output`, `TransformerBlock.finish`); a subclass whose blocks are not
    # these (MoE) says False.
    segmented_decode: ClassVar[bool] = True

    def __init__(self, args: ModelArgs, attention_cls: type[Attention] = Attention) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LlamaModel(args, attention_cls)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size)
        self._windows = self.layer_windows()
        self._masks = LayerMasks(self._windows)

    def layer_windows(self) -> list[int | None]:
        return self.args.layer_windows()

    @property
    def layers(self) -> list[TransformerBlock]:
        return self.model.layers

    def __call__(self, inputs: Array, cache: list[Cache] | None = None, mask: Array | None = None, *,
                 last_only: bool = False) -> Array:
        inner = self.model
        h = inner.embed_tokens(inputs)
        masks = self._masks(inputs.shape[1], cache, mask)
        last = len(inner.layers) - 1
        if cache is None:
            for i, (layer, m) in enumerate(zip(inner.layers, masks, strict=False)):
                h = layer(h, m, None, last_only and i == last)
        else:
            for i, (layer, m, c) in enumerate(zip(inner.layers, masks, cache, strict=False)):
                # The last layer's queries, attention output and MLP on the last position alone.
                h = layer(h, m, c, last_only and i == last)
                after_layer(h, c)
        return self.output(h[:, -1:] if last_only else h)

    def output(self, h: Array) -> Array:
        """Hidden states after the last layer -> logits (the final norm and the head)."""
        inner = self.model
        h = inner.norm(h)
        head = self.lm_head
        return inner.embed_tokens.as_linear(h) if head is None else head(h)

    def make_cache(self, context_len: int | None = None) -> list[Cache]:
        return make_layer_caches(self._windows, context_len)

    def sanitize(self, weights: dict[str, Array]) -> dict[str, Array]:
        weights = drop_keys(weights, "self_attn.rotary_emb.inv_freq")
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights
