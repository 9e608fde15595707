"""Gemma 4 text (`gemma4_text`, and the language model inside the multimodal `gemma4`, whose vision
and audio towers are dropped on load). Config names, defaults and numerics are mlx-lm 0.32.2's:

- sliding-window layers (`head_dim`, RoPE `rope_parameters.sliding_attention`) and full-attention
  layers (`global_head_dim`, RoPE `rope_parameters.full_attention`, typically "proportional":
  only the first `partial_rotary_factor` of the frequencies rotate), mixed as `layer_types` says;
- plain RMSNorms (weight as stored, no 1 + w), q/k norms per head, a scale-free RMSNorm on the
  values, attention scale 1;
- K = V on full-attention layers with `attention_k_eq_v` (no v_proj; `num_global_key_value_heads`);
- the last `num_kv_shared_layers` layers have no k/v of their own: each reuses the keys, values and
  position of the last earlier layer of its type (they get no cache), and with
  `use_double_wide_mlp` their MLP is twice as wide;
- per-layer input embeddings (`hidden_size_per_layer_input`): a second embedding table plus a
  projection of the embeddings give each layer a small gated input;
- the MoE block (`enable_moe_block`): a dense GeGLU MLP and, beside it, `num_experts` stacked GeGLU
  experts picked by a router (scale-free RMSNorm * `scale` / sqrt(hidden), top `top_k_experts` of
  the logits, softmax over those, times `per_expert_scale`); HF's `experts.gate_up_proj` is split;
- a learnt per-layer output scalar, embeddings scaled by sqrt(hidden), final logit soft-capping.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array

from .. import nn
from ..cache import Cache, Mask
from ..config_check import ConfigError
from .base import (
    BaseModelArgs,
    LayerMasks,
    RoPE,
    TiedHead,
    after_layer,
    attention,
    initialize_rope,
    make_layer_caches,
    rope_scaling_type,
    softcap,
)
from .switch_layers import SwitchGLU, geglu

_reshape = mx.reshape
_transpose = mx.transpose
_rms_norm = mx.fast.rms_norm

SLIDING, FULL = "sliding_attention", "full_attention"
_TOWERS = ("vision_tower", "multi_modal_projector", "audio_tower", "embed_audio", "embed_vision",
           "vision_embedder")
_DROPPED = ("self_attn.rotary_emb", "input_max", "input_min", "output_max", "output_min")


def _default_rope_parameters() -> dict[str, dict[str, Any]]:
    return {FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            SLIDING: {"partial_rotary_factor": 1.0, "rope_theta": 10000.0, "rope_type": "default"}}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "gemma4_text"
    hidden_size: int = 1536
    num_hidden_layers: int = 35
    intermediate_size: int = 6144
    num_attention_heads: int = 8
    head_dim: int = 256
    global_head_dim: int = 512
    rms_norm_eps: float = 1e-6
    vocab_size: int = 262144
    vocab_size_per_layer_input: int = 262144
    num_key_value_heads: int = 1
    num_global_key_value_heads: int | None = None
    num_kv_shared_layers: int = 20
    hidden_size_per_layer_input: int = 256
    rope_traditional: bool = False
    rope_parameters: dict[str, Any] | None = None
    sliding_window: int = 512
    sliding_window_pattern: int = 5
    max_position_embeddings: int = 131072
    attention_k_eq_v: bool = False
    final_logit_softcapping: float | None = 30.0
    use_double_wide_mlp: bool = True
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    layer_types: list[str] | None = None
    tie_word_embeddings: bool = True

    @classmethod
    def from_dict(cls, params: Mapping[str, Any], prefix: str = "") -> ModelArgs:
        """Also takes the multimodal `gemma4` config: the text model's fields are under `text_config`
        (with mlx-lm's fallbacks: the top-level vocab_size, 8 heads, 1 kv head)."""
        if params.get("model_type") == "gemma4" or isinstance(params.get("text_config"), Mapping):
            if not isinstance(params.get("text_config") or {}, Mapping):
                raise ConfigError(f"text_config: expected an object, got {type(params['text_config']).__name__}")
            text = dict(params.get("text_config") or {})
            text["vocab_size"] = params.get("vocab_size", text.get("vocab_size", 262144))
            text.setdefault("num_attention_heads", 8)
            text.setdefault("num_key_value_heads", 1)
            text.setdefault("model_type", "gemma4_text")
            params, prefix = text, prefix + "text_config."
        return super().from_dict(params, prefix)

    def __post_init__(self) -> None:
        if self.rope_parameters is None:
            self.rope_parameters = _default_rope_parameters()
        if self.layer_types is None:
            pattern = [SLIDING] * (self.sliding_window_pattern - 1) + [FULL]
            self.layer_types = (pattern * (self.num_hidden_layers // len(pattern) + 1))[: self.num_hidden_layers]
        # layer_types' length and values are checked with the other fields (config_check.check_args).
        if self.enable_moe_block and not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
            raise ConfigError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")

    @property
    def first_kv_shared(self) -> int:
        """Index of the first layer that reuses an earlier layer's keys and values."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    def layer_windows(self) -> list[int | None]:
        return [self.sliding_window if t == SLIDING else None for t in self.layer_types]  # type: ignore[union-attr]

    def kv_sources(self) -> list[int]:
        """For each layer, the layer whose keys/values it attends to (itself unless shared): the last
        layer of the same type before the shared tail."""
        n, first = self.num_hidden_layers, self.first_kv_shared
        sources = list(range(n))
        if self.num_kv_shared_layers > 0:
            last_of: dict[str, int] = {}
            for i in range(first):
                last_of[self.layer_types[i]] = i  # type: ignore[index]
            for j in range(first, n):
                kind = self.layer_types[j]  # type: ignore[index]
                if kind not in last_of:
                    raise ConfigError(f"layer {j} shares the keys/values of an earlier {kind} layer, but the "
                                      f"first {first} layers have none")
                sources[j] = last_of[kind]
        return sources


def make_rope(dims: int, params: Mapping[str, Any], traditional: bool) -> RoPE:
    """RoPE for one layer type's `rope_parameters` entry. "proportional" rotates the first
    `partial_rotary_factor` of the frequency pairs (frequencies from the full `dims`) and leaves
    the others fixed (infinite wavelength); "default" rotates everything."""
    base = float(params.get("rope_theta", 10000.0))
    kind = rope_scaling_type(params)
    if kind != "proportional":
        return initialize_rope(dims, base, traditional, None if kind == "default" else params)
    rotated = int(dims * params.get("partial_rotary_factor", 1.0))
    if rotated > dims:
        raise ConfigError(f"partial_rotary_factor {params.get('partial_rotary_factor')} rotates more than {dims} dims")
    exponents = mx.arange(0, rotated, 2, mx.float32) / dims
    freqs = mx.concatenate([float(params.get("factor", 1.0)) * (base**exponents),
                            mx.full(((dims - rotated) // 2,), math.inf, mx.float32)])
    mx.eval(freqs)
    return RoPE(dims, base=base, traditional=traditional, freqs=freqs)


class RMSNormNoScale(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        return _rms_norm(x, None, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, i: int) -> None:
        super().__init__()
        layer_type = args.layer_types[i]  # type: ignore[index]
        sliding = layer_type == SLIDING
        self.has_kv = i < args.first_kv_shared
        self.head_dim = hd = args.global_head_dim if layer_type == FULL and args.global_head_dim else args.head_dim
        self.n_heads = args.num_attention_heads
        self.k_eq_v = args.attention_k_eq_v and not sliding
        if self.k_eq_v and args.num_global_key_value_heads is not None:
            self.n_kv_heads = args.num_global_key_value_heads
        else:
            self.n_kv_heads = args.num_key_value_heads
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.q_proj = nn.Linear(dim, self.n_heads * hd)
        if self.has_kv:
            self.k_proj = nn.Linear(dim, self.n_kv_heads * hd)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(dim, self.n_kv_heads * hd)
        self.o_proj = nn.Linear(self.n_heads * hd, dim)
        self.q_norm = nn.RMSNorm(hd, eps)
        if self.has_kv:
            self.k_norm = nn.RMSNorm(hd, eps)
            self.v_norm = RMSNormNoScale(eps)
        rope_params = args.rope_parameters.get(SLIDING if sliding else FULL, {})  # type: ignore[union-attr]
        self.rope = make_rope(hd, rope_params, args.rope_traditional)

    def __call__(self, x: Array, mask: Mask, cache: Cache | None, shared: tuple[Array, Array] | None,
                 offset: int) -> tuple[Array, tuple[Array, Array], int]:
        """Returns the output, the keys/values attended to and their start position (for the layers
        that share them)."""
        b, L, _ = x.shape
        q = self.q_norm(_reshape(self.q_proj(x), (b, L, self.n_heads, self.head_dim)))
        if shared is not None:
            k, v = shared
        else:
            k = _reshape(self.k_proj(x), (b, L, self.n_kv_heads, self.head_dim))
            v = k if self.k_eq_v else _reshape(self.v_proj(x), (b, L, self.n_kv_heads, self.head_dim))
            offset = cache.offset if cache is not None else 0
            k = self.rope(_transpose(self.k_norm(k), (0, 2, 1, 3)), offset)
            v = _transpose(self.v_norm(v), (0, 2, 1, 3))
        q = self.rope(_transpose(q, (0, 2, 1, 3)), offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = attention(q, k, v, scale=1.0, mask=mask)
        return self.o_proj(_reshape(_transpose(out, (0, 2, 1, 3)), (b, L, -1))), (k, v), offset


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim)
        self.down_proj = nn.Linear(hidden_dim, dim)
        self.up_proj = nn.Linear(dim, hidden_dim)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


class Router(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.eps = args.rms_norm_eps
        self.top_k = int(args.top_k_experts)  # type: ignore[arg-type]
        self.proj = nn.Linear(args.hidden_size, int(args.num_experts))  # type: ignore[arg-type]
        self.scale = mx.ones((args.hidden_size,))
        self.per_expert_scale = mx.ones((int(args.num_experts),))  # type: ignore[arg-type]
        self._root_size = args.hidden_size**-0.5

    def __call__(self, x: Array) -> tuple[Array, Array]:
        logits = self.proj(_rms_norm(x, self.scale * self._root_size, self.eps))
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(logits, kth=-k, axis=-1)[..., -k:])
        weights = mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1)
        return inds, weights * mx.take(self.per_expert_scale, inds, axis=0)


class Experts(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.switch_glu = SwitchGLU(args.hidden_size, int(args.moe_intermediate_size),  # type: ignore[arg-type]
                                    int(args.num_experts), activation=geglu)  # type: ignore[arg-type]

    def __call__(self, x: Array, inds: Array, weights: Array) -> Array:
        return mx.sum(mx.expand_dims(weights, -1) * self.switch_glu(x, inds), axis=-2)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, i: int) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, i)
        wide = args.use_double_wide_mlp and i >= args.first_kv_shared > 0
        self.mlp = MLP(dim, args.intermediate_size * (2 if wide else 1))
        self.input_layernorm = nn.RMSNorm(dim, eps)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(dim, eps)
        self.post_feedforward_layernorm = nn.RMSNorm(dim, eps)
        self.moe = args.enable_moe_block
        if self.moe:
            self.router = Router(args)
            self.experts = Experts(args)
            self.post_feedforward_layernorm_1 = nn.RMSNorm(dim, eps)
            self.post_feedforward_layernorm_2 = nn.RMSNorm(dim, eps)
            self.pre_feedforward_layernorm_2 = nn.RMSNorm(dim, eps)
        self.per_layer = bool(args.hidden_size_per_layer_input)
        if self.per_layer:
            self.per_layer_input_gate = nn.Linear(dim, args.hidden_size_per_layer_input)
            self.per_layer_projection = nn.Linear(args.hidden_size_per_layer_input, dim)
            self.post_per_layer_input_norm = nn.RMSNorm(dim, eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x: Array, mask: Mask, cache: Cache | None, per_layer_input: Array | None,
                 shared: tuple[Array, Array] | None, offset: int) -> tuple[Array, tuple[Array, Array], int]:
        a, kv, offset = self.self_attn(self.input_layernorm(x), mask, cache, shared, offset)
        h = x + self.post_attention_layernorm(a)
        if self.moe:
            dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
            inds, weights = self.router(h)
            sparse = self.experts(self.pre_feedforward_layernorm_2(h), inds, weights)
            f = dense + self.post_feedforward_layernorm_2(sparse)
        else:
            f = self.mlp(self.pre_feedforward_layernorm(h))
        h = h + self.post_feedforward_layernorm(f)
        if self.per_layer and per_layer_input is not None:
            g = nn.gelu_approx(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h * self.layer_scalar, kv, offset


class Gemma4TextModel(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        n, p, eps = args.num_hidden_layers, args.hidden_size_per_layer_input, args.rms_norm_eps
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(n)]
        self.norm = nn.RMSNorm(args.hidden_size, eps)
        if p:
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, n * p)
            self.per_layer_model_projection = nn.Linear(args.hidden_size, n * p)
            self.per_layer_projection_norm = nn.RMSNorm(p, eps)


class Model(TiedHead, nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Gemma4TextModel(args)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size)
        self._windows = args.layer_windows()
        self._masks = LayerMasks(self._windows)
        self._sources = args.kv_sources()
        self._final_cap = args.final_logit_softcapping
        self._embed_scale = args.hidden_size**0.5
        p = args.hidden_size_per_layer_input
        self._per_layer = (args.num_hidden_layers, p) if p else None
        self._per_layer_embed_scale = p**0.5 if p else 1.0
        self._per_layer_projection_scale = args.hidden_size**-0.5

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def _per_layer_inputs(self, inputs: Array, h: Array) -> list[Array | None]:
        """Each layer's extra input [B, L, P]: its slice of the per-layer embedding table plus the
        normalised projection of the (scaled) embeddings, averaged in norm (times 1/sqrt 2)."""
        inner = self.model
        if self._per_layer is None:
            return [None] * len(inner.layers)
        table = mx.unflatten(inner.embed_tokens_per_layer(inputs) * self._per_layer_embed_scale, -1, self._per_layer)
        proj = inner.per_layer_model_projection(h) * self._per_layer_projection_scale
        proj = inner.per_layer_projection_norm(mx.unflatten(proj, -1, self._per_layer))
        both = (proj + table) * 2.0**-0.5
        return [both[:, :, i, :] for i in range(len(inner.layers))]

    def __call__(self, inputs: Array, cache: list[Cache] | None = None, mask: Array | None = None, *,
                 last_only: bool = False) -> Array:
        inner = self.model
        h = inner.embed_tokens(inputs) * self._embed_scale
        per_layer = self._per_layer_inputs(inputs, h)
        masks = self._masks(inputs.shape[1], cache, mask)
        n = len(inner.layers)
        caches: list[Cache | None] = [None] * n if cache is None else list(cache) + [None] * (n - len(cache))
        kvs: list[tuple[tuple[Array, Array] | None, int]] = [(None, 0)] * n
        layer_inputs = zip(inner.layers, masks, caches, self._sources, per_layer, strict=False)
        for i, (layer, m, c, src, pli) in enumerate(layer_inputs):
            shared, offset = kvs[src] if src != i else (None, 0)
            h, kv, offset = layer(h, m, c, pli, shared, offset)
            kvs[i] = (kv, offset)
            after_layer(h, c)
        return self.output(h[:, -1:] if last_only else h)

    def output(self, h: Array) -> Array:
        """Hidden states after the last layer -> logits (the final norm, the head, the softcap)."""
        inner = self.model
        h = inner.norm(h)
        head = self.lm_head
        out = inner.embed_tokens.as_linear(h) if head is None else head(h)
        return softcap(out, self._final_cap) if self._final_cap is not None else out

    def make_cache(self, context_len: int | None = None) -> list[Cache]:
        """One cache per layer with its own keys/values (the shared tail has none)."""
        return make_layer_caches(self._windows[: self.args.first_kv_shared], context_len)

    def sanitize(self, weights: dict[str, Array]) -> dict[str, Array]:
        first_shared = self.args.first_kv_shared
        out: dict[str, Array] = {}
        for k, v in weights.items():
            if k.removeprefix("model.").startswith(_TOWERS) or any(s in k for s in _DROPPED):
                continue
            if (".self_attn.k_proj" in k or ".self_attn.v_proj" in k or ".self_attn.k_norm" in k) and "layers." in k:
                layer = k.split("layers.")[1].split(".")[0]
                if layer.isdigit() and int(layer) >= first_shared:
                    continue  # the shared tail's own k/v (if stored) are never used
            if k.endswith(".experts.gate_up_proj"):
                base = k.removesuffix(".gate_up_proj")
                gate, up = mx.split(v, 2, axis=-2)
                out[f"{base}.switch_glu.gate_proj.weight"] = mx.contiguous(gate)
                out[f"{base}.switch_glu.up_proj.weight"] = mx.contiguous(up)
            elif k.endswith(".experts.down_proj"):
                out[k.removesuffix(".down_proj") + ".switch_glu.down_proj.weight"] = v
            else:
                out[k] = v
        if self.args.tie_word_embeddings:
            out = {k: v for k, v in out.items() if not k.startswith("lm_head.")}
        return out
