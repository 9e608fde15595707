"""Gemma 3 text (`gemma3_text`, and the language model inside the multimodal `gemma3`): Gemma 2's
block (four (1 + w) norms, GELU-tanh MLP, scaled embeddings) with an RMSNorm over each q/k head,
no soft-capping, and a 5:1 mix of sliding-window layers (RoPE base `rope_local_base_freq`) and
global layers (RoPE base `rope_theta`, with the checkpoint's `rope_scaling`)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pymlxc.core as mx
from pymlxc.core import Array

from .. import nn
from ..cache import Cache, Mask
from ..kernels import add_rms_norm as norm_kernel
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
    prefill_kernel = False  # a causal chunk's attention through pymlxc's CUDA kernel (nn.mark_prefill_attention)

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
        # q/k/v as one matmul for one token: set on a decode trace's own copy (`Model.use_decode_fusions`).
        self._qkv: Callable[[Array], list[Array]] | None = None

    def qk_norms(self) -> tuple[nn.Module, ...]:
        """The norms a fused q/k/v projection may join: none (these are offset norms, applied apart)."""
        return ()

    def __call__(self, x: Array, mask: Mask, cache: Cache | None, last_only: bool = False) -> Array:
        """`last_only`: every position's keys and values into `cache`, the last query's output alone."""
        b, L, _ = x.shape
        if self._qkv is not None and L == 1:
            q, k, v = self._qkv(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(_transpose(_reshape(q, (b, L, self.n_heads, self.head_dim)), (0, 2, 1, 3)))
        k = self.k_norm(_transpose(_reshape(k, (b, L, self.n_kv_heads, self.head_dim)), (0, 2, 1, 3)))
        v = _transpose(_reshape(v, (b, L, self.n_kv_heads, self.head_dim)), (0, 2, 1, 3))
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
        # gate/up as one matmul for one token: set on a decode trace's own copy (`Model.use_decode_fusions`).
        self._gate_up: Callable[[Array], list[Array]] | None = None

    def __call__(self, x: Array) -> Array:
        if self._gate_up is not None and x.shape[1] == 1:
            gate, up = self._gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(nn.gelu_approx(gate) * up)


_F16_MAX = 65504.0


def _residual(x: Array, y: Array) -> Array:
    """x + y; in float16 the sum is formed in float32 and clipped, as Gemma 3's activations can
    exceed float16's range."""
    if x.dtype != mx.float16:
        return x + y
    s = mx.astype(x, mx.float32) + mx.astype(y, mx.float32)
    return mx.astype(mx.clip(s, -_F16_MAX, _F16_MAX), mx.float16)


AddNorm = Callable[[Array, Array, Any], tuple[Array, Array]]


def add_norm(x: Array, y: Array, norm: Any) -> tuple[Array, Array]:
    """(x + y as Gemma adds a residual, norm of that sum)."""
    h = _residual(x, y)
    return h, norm(h)


def kernel_add_norm(x: Array, y: Array, norm: Any) -> tuple[Array, Array]:
    """`add_norm` as one CUDA kernel (`kernels/add_rms_norm.py`, the norm's 1 + w its weight: bit for
    bit MLX's add and rms_norm) where the types agree and are not float16 (summed in float32)."""
    scale = norm.scale
    if x.dtype == y.dtype == scale.dtype and x.dtype != mx.float16:
        both: tuple[Array, Array] = norm_kernel.add_rms_norm(x, y, scale, norm.eps)
        return both
    return add_norm(x, y, norm)


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
        h, out = self.halves(x, self.input_layernorm(x), mask, cache, last_only, add_norm)
        return _residual(h, out)

    def halves(self, x: Array, normed: Array, mask: Mask, cache: Cache | None, last_only: bool,
               add: AddNorm) -> tuple[Array, Array]:
        """The block on `x` whose input norm is `normed`: (x after the attention's residual, the
        MLP's normalized output). The caller adds the two with the norm that follows (`Model`), so
        that each residual add and the norm after it can be one kernel (`add`)."""
        r = self.self_attn(normed, mask, cache, last_only)
        h, n = add(x[:, -1:] if last_only else x, self.post_attention_layernorm(r), self.pre_feedforward_layernorm)
        return h, self.post_feedforward_layernorm(self.mlp(n))


class Gemma3Model(nn.Module):
    def __init__(self, args: ModelArgs, windows: list[int | None]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, w is not None) for w in windows]
        self.norm = nn.OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(TiedHead, nn.Module):
    # The whole-step decode graph may fuse each block's projections and its residual adds with the
    # norms after them (decode/graph_fusions.py).
    decode_fusions: ClassVar[bool] = True

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
        self._add_norm: AddNorm = add_norm  # a decode trace's copy may take a one-kernel form

    @property
    def layers(self) -> list[TransformerBlock]:
        return self.model.layers

    def __call__(self, inputs: Array, cache: list[Cache] | None = None, mask: Array | None = None, *,
                 last_only: bool = False) -> Array:
        inner = self.model
        h = inner.embed_tokens(inputs) * self._embed_scale
        masks = self._masks(inputs.shape[1], cache, mask)
        caches = cache if cache is not None else [None] * len(masks)
        layers = inner.layers
        last = len(layers) - 1
        if not layers or any(type(layer) is not TransformerBlock for layer in layers):
            # Blocks another owner wrapped (a pipeline's stages) run whole, each norm inside its block.
            for i, (layer, m, c) in enumerate(zip(layers, masks, caches, strict=False)):
                h = layer(h, m, c, last_only and i == last)
                after_layer(h, c)
            return self.output(h[:, -1:] if last_only else h)
        norms = [layer.input_layernorm for layer in layers[1:]] + [inner.norm]
        normed = layers[0].input_layernorm(h)
        for i, (layer, m, c) in enumerate(zip(layers, masks, caches, strict=False)):
            # The last layer's queries, attention output and MLP on the last position alone.
            h, out = layer.halves(h, normed, m, c, last_only and i == last, self._add_norm)
            h, normed = self._add_norm(h, out, norms[i])
            after_layer(h, c)
        return self.head(normed)

    def output(self, h: Array) -> Array:
        """Hidden states after the last layer -> logits (the final norm, the head, the softcap)."""
        return self.head(self.model.norm(h))

    def head(self, h: Array) -> Array:
        """Hidden states after the final norm -> logits (the head, the softcap)."""
        inner = self.model
        head = self.lm_head
        out = inner.embed_tokens.as_linear(h) if head is None else head(h)
        return softcap(out, self._final_cap) if self._final_cap else out

    def decode_add_norms(self) -> Sequence[nn.Module]:
        """The norms that follow a residual add in the forward pass (`_add_norm`'s third argument)."""
        layers = self.model.layers
        return ([b.pre_feedforward_layernorm for b in layers] + [b.input_layernorm for b in layers[1:]]
                + [self.model.norm])

    def use_decode_fusions(self, pairs: Sequence[tuple[Any, Any]], fused_norm: bool) -> None:
        """On a decode trace's own copy of the model, never on a model in use: each block's fused
        (q/k/v, gate/up) projections (None: apart), and with `fused_norm` each residual add and the
        norm after it as one CUDA kernel (`kernel_add_norm`; the caller checked that it applies)."""
        for block, (qkv, gate_up) in zip(self.model.layers, pairs, strict=True):
            block.self_attn._qkv = qkv  # noqa: SLF001 - the trace's copy, set by its owner
            block.mlp._gate_up = gate_up  # noqa: SLF001
        self._add_norm = kernel_add_norm if fused_norm else add_norm

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
