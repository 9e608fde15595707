"""Qwen3-Next (`qwen3_next`): three Gated DeltaNet (linear attention) layers to one gated full
attention layer (`full_attention_interval`), with sparse MoE MLPs that add a sigmoid-gated shared
expert. Qwen 3.5 (qwen3_5.py) reuses these blocks.

Linear layers (`linear_attn`): one projection gives q, k, v, the output gate z and the write (b)
and decay (a) gates, grouped per key head; q, k, v pass a causal depthwise convolution (window
`linear_conv_kernel_dim`) and SiLU, q and k are L2-normalised, and the delta rule (gated_delta.py)
runs over the value heads; the output is RMS-normalised per head and gated by SiLU(z). Their cache
is a RecurrentCache (conv window + state). Attention layers: the q projection carries a per-head
output gate (sigmoid), q/k RMSNorm per head, RoPE on the first `partial_rotary_factor` of each head.

HF checkpoints store the RMSNorm weights (but the gated norm's) as offsets from 1, the conv weight
as [C, 1, K] and the experts apart; `sanitize` turns them into mlx-lm's layout, which mlx-lm's
(quantized) checkpoints have already. The multi-token prediction head (`mtp.*`) is dropped.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array

from .. import nn
from ..cache import Cache, Mask
from ..config_check import ConfigError
from ..kernels import gated_delta as kernels
from ..recurrent_cache import RecurrentCache
from . import gated_delta, llama, qwen2_moe
from .base import (
    BaseModelArgs,
    LayerMasks,
    TiedHead,
    after_layer,
    attention,
    initialize_rope,
    last_query,
    make_layer_caches,
    resolved,
    rope_and_cache,
    rope_scaling_type,
)
from .qwen3_moe import ExpertLayers, combine, stack_experts, top_k_routing

_reshape = mx.reshape
_transpose = mx.transpose
NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")


@dataclass
class ModelArgs(BaseModelArgs, ExpertLayers):
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    model_type: str = "qwen3_next"
    num_key_value_heads: int = 2
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int | None = None
    attention_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    tie_word_embeddings: bool | None = None  # None: tied when the checkpoint has no lm_head
    full_attention_interval: int = 4
    linear_num_value_heads: int = 32
    linear_num_key_heads: int = 16
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        params = self.rope_parameters
        if params:  # transformers >= 5 nests rope_theta, the rotary fraction and the scaling here
            self.rope_theta = float(params.get("rope_theta", self.rope_theta))
            self.partial_rotary_factor = float(params.get("partial_rotary_factor", self.partial_rotary_factor))
            if self.rope_scaling is None and rope_scaling_type(params) != "default":
                self.rope_scaling = params
        positive = {"full_attention_interval": self.full_attention_interval,
                    "linear_num_value_heads": self.linear_num_value_heads,
                    "linear_num_key_heads": self.linear_num_key_heads,
                    "linear_key_head_dim": self.linear_key_head_dim,
                    "linear_value_head_dim": self.linear_value_head_dim,
                    "linear_conv_kernel_dim": self.linear_conv_kernel_dim}
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"{name}: expected an integer of at least 1, got {value}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads: {self.linear_num_value_heads} is not a multiple of "
                              f"linear_num_key_heads {self.linear_num_key_heads}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ConfigError(f"partial_rotary_factor: expected a number in (0, 1], got {self.partial_rotary_factor}")
        self.check_experts()
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ConfigError(f"moe_intermediate_size: {self.num_experts} experts need a size of at least 1")

    def is_linear(self, i: int) -> bool:
        return (i + 1) % self.full_attention_interval != 0


# ---------------------------------------------------------------------- blocks

@functools.cache
def _gated_silu() -> Any:
    # Compiled and shapeless as mlx-lm's precise_swiglu, so the CPU rounds alike.
    return mx.compile(lambda h, gate, x: (nn.silu(gate.astype(mx.float32)) * x.astype(mx.float32)).astype(h.dtype),
                      shapeless=True)


class RMSNormGated(nn.Module):
    """RMSNorm of each head's output, times SiLU(z) (in float32)."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: Array, gate: Array) -> Array:
        out: Array = _gated_silu()(x, gate, mx.fast.rms_norm(x, self.weight, self.eps))
        return out


class Attention(nn.Module):
    """Full attention with a per-head sigmoid output gate carried by q_proj."""
    prefill_kernel = False  # a causal chunk's attention through pymlxc's CUDA kernel (nn.mark_prefill_attention)


    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, bias = args.hidden_size, args.attention_bias
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = resolved(args.num_key_value_heads, "num_key_value_heads")
        self.head_dim = hd = resolved(args.head_dim, "head_dim")
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * hd * 2, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        scaling = args.rope_scaling if rope_scaling_type(args.rope_scaling) != "default" else None
        self.rope = initialize_rope(int(hd * args.partial_rotary_factor), args.rope_theta, False, scaling)

    def __call__(self, x: Array, mask: Mask, cache: Cache | None, last_only: bool = False) -> Array:
        b, L, _ = x.shape
        q, gate = mx.split(_reshape(self.q_proj(x), (b, L, self.n_heads, 2 * self.head_dim)), 2, axis=-1)
        q = _transpose(self.q_norm(q), (0, 2, 1, 3))
        k = _transpose(self.k_norm(_reshape(self.k_proj(x), (b, L, self.n_kv_heads, self.head_dim))), (0, 2, 1, 3))
        v = _transpose(_reshape(self.v_proj(x), (b, L, self.n_kv_heads, self.head_dim)), (0, 2, 1, 3))
        q, k, v = rope_and_cache(self.rope, q, k, v, cache)
        if last_only:
            q, mask = last_query(q, mask)
            gate = gate[:, -1:]
        out = attention(q, k, v, scale=self.scale, mask=mask, kernel=self.prefill_kernel)
        out = _reshape(_transpose(out, (0, 2, 1, 3)), (b, q.shape[2], -1))
        return self.o_proj(out * mx.sigmoid(_reshape(gate, (b, q.shape[2], -1))))


class GatedDeltaNet(nn.Module):
    """The linear attention layer; `project` (per checkpoint layout) gives q/k/v, z, b, a."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_v_heads = args.linear_num_value_heads
        self.num_k_heads = args.linear_num_key_heads
        self.head_k_dim = args.linear_key_head_dim
        self.head_v_dim = args.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = args.linear_conv_kernel_dim
        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.conv1d = Conv1d(self.conv_dim, self.conv_kernel_size)
        self.dt_bias = mx.ones((self.num_v_heads,))
        self.A_log = mx.zeros((self.num_v_heads,))
        self.norm = RMSNormGated(self.head_v_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, args.hidden_size)
        self.make_projections(args)

    def make_projections(self, args: ModelArgs) -> None:
        """Qwen3-Next: q, k, v, z in one projection and b, a in another, grouped per key head."""
        self.in_proj_qkvz = nn.Linear(args.hidden_size, self.key_dim * 2 + self.value_dim * 2)
        self.in_proj_ba = nn.Linear(args.hidden_size, self.num_v_heads * 2)

    def project(self, x: Array) -> tuple[Array, Array, Array, Array]:
        """x [B, S, hidden] -> q|k|v [B, S, conv_dim], z [B, S, Hv, Dv], b, a [B, S, Hv]."""
        bsz, s, _ = x.shape
        nk, dk, dv = self.num_k_heads, self.head_k_dim, self.head_v_dim
        per = self.num_v_heads // nk
        qkvz = _reshape(self.in_proj_qkvz(x), (bsz, s, nk, -1))
        ba = _reshape(self.in_proj_ba(x), (bsz, s, nk, -1))
        q, k, v, z = mx.split(qkvz, [dk, 2 * dk, 2 * dk + per * dv], axis=-1)
        b, a = mx.split(ba, [per], axis=-1)
        qkv = mx.concatenate([_reshape(q, (bsz, s, -1)), _reshape(k, (bsz, s, -1)), _reshape(v, (bsz, s, -1))],
                             axis=-1)
        return (qkv, _reshape(z, (bsz, s, -1, dv)), _reshape(b, (bsz, s, self.num_v_heads)),
                _reshape(a, (bsz, s, self.num_v_heads)))

    def __call__(self, x: Array, cache: Any, last_only: bool = False) -> Array:
        bsz, s, _ = x.shape
        qkv, z, b, a = self.project(x)
        valid = cache.token_mask(s) if cache is not None else None
        if valid is not None:
            qkv = mx.where(valid[..., None], qkv, mx.array(0.0, qkv.dtype))
        conv_state = cache.conv if cache is not None and cache.conv is not None else None
        if conv_state is None:
            conv_state = mx.zeros((bsz, self.conv_kernel_size - 1, self.conv_dim), qkv.dtype)
        conv_in = mx.concatenate([conv_state, qkv], axis=1)
        keep = self.conv_kernel_size - 1
        new_conv = mx.contiguous(conv_in[:, conv_in.shape[1] - keep:]) if keep else conv_state
        conv_out = nn.silu(self.conv1d(conv_in))
        q, k, v = mx.split(conv_out, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = _reshape(q, (bsz, s, self.num_k_heads, self.head_k_dim))
        k = _reshape(k, (bsz, s, self.num_k_heads, self.head_k_dim))
        v = _reshape(v, (bsz, s, self.num_v_heads, self.head_v_dim))
        q, k = gated_delta.normalize_qk(q, k, self.head_k_dim)
        state = cache.recurrent if cache is not None and cache.recurrent is not None else None
        if state is None:
            state = mx.zeros((bsz, self.num_v_heads, self.head_v_dim, self.head_k_dim), mx.float32)
        beta = mx.sigmoid(b)
        if s == 1 and valid is None:
            y, state = self._step(q, k, v, gated_delta.decay(self.A_log, a, self.dt_bias), beta, state)
        else:
            y, state = gated_delta.chunked(q, k, v, gated_delta.log_decay(self.A_log, a, self.dt_bias), beta, state,
                                           valid)
        if cache is not None:
            cache.update(new_conv, state, s)
        if last_only:
            y, z = y[:, -1:], z[:, -1:]
        out = self.norm(y, z)
        return self.out_proj(_reshape(out, (bsz, out.shape[1], -1)))

    def kernel_dims(self) -> tuple[int, int, int, int, int]:
        """(Dk, Dv, Hk, Hv, T) of a one-token step, as the kernel check keys them."""
        return self.head_k_dim, self.head_v_dim, self.num_k_heads, self.num_v_heads, 1

    def _step(self, q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array) -> tuple[Array, Array]:
        """One token: the fused kernel where it passed its check here, else MLX operations."""
        kind = kernels.ready(self.kernel_dims(), q.dtype, _ops_one_token)
        if kind is not None:
            return kernels.run(kind, q, k, v, g, beta, state)
        hv = self.num_v_heads
        y, state = gated_delta.step(gated_delta.repeat_heads(q, hv)[:, 0], gated_delta.repeat_heads(k, hv)[:, 0],
                                    v[:, 0], g[:, 0], beta[:, 0], state)
        return y[:, None], state


def _ops_one_token(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array) -> tuple[Array, Array]:
    """The operations the kernel is checked against: tokens one at a time (T may exceed 1)."""
    return gated_delta.recurrent(q, k, v, g, beta, state)


class Conv1d(nn.Module):
    """Depthwise causal convolution over time, weight [C, K, 1] (mlx-lm's layout), no bias."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = mx.zeros((channels, kernel_size, 1))

    def __call__(self, x: Array) -> Array:
        return mx.conv1d(x, self.weight, 1, 0, 1, self.weight.shape[0])


class SparseMoeBlock(qwen2_moe.SparseMoeBlock):
    """Qwen 2 MoE's block (softmax router, top-k experts renormalised when `norm_topk_prob`, a
    shared expert scaled by sigmoid(shared_expert_gate)) with Qwen 3 MoE's order of the k, as mlx-lm."""

    def __call__(self, x: Array) -> Array:
        gates = mx.softmax(self.gate(x), axis=-1, precise=True)
        inds, scores = top_k_routing(gates, self.top_k, normalize=self.norm_topk_prob)
        y = combine(self.switch_mlp(x, inds), scores)
        return y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, i: int, linear_cls: type[GatedDeltaNet] = GatedDeltaNet,
                 moe: bool | None = None) -> None:
        super().__init__()
        self.is_linear = args.is_linear(i)
        if self.is_linear:
            self.linear_attn = linear_cls(args)
        else:
            self.self_attn = Attention(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        moe = args.is_moe_layer(i) if moe is None else moe
        self.mlp = SparseMoeBlock(args) if moe else llama.MLP(args.hidden_size, args.intermediate_size)

    def __call__(self, x: Array, mask: Mask, cache: Any, last_only: bool = False) -> Array:
        h = self.input_layernorm(x)
        r = self.linear_attn(h, cache, last_only) if self.is_linear else self.self_attn(h, mask, cache, last_only)
        h = (x[:, -1:] if last_only else x) + r
        return h + self.mlp(self.post_attention_layernorm(h))


class TextModel(nn.Module):
    def __init__(self, args: ModelArgs, layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = layers
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(TiedHead, nn.Module):
    """Token ids [B, L] -> logits [B, L, vocab]; the base of Qwen 3.5."""

    linear_cls: type[GatedDeltaNet] = GatedDeltaNet

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = TextModel(args, [DecoderLayer(args, i, self.linear_cls, self.moe_layer(i))
                                      for i in range(args.num_hidden_layers)])
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size)
        self._attention_at = next((i for i in range(args.num_hidden_layers) if not args.is_linear(i)), None)
        self._masks = LayerMasks([None])

    def moe_layer(self, i: int) -> bool:
        return self.args.is_moe_layer(i)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def layer_windows(self) -> list[int | None]:
        return [None] * self.args.num_hidden_layers

    def __call__(self, inputs: Array, cache: list[Any] | None = None, mask: Array | None = None, *,
                 last_only: bool = False) -> Array:
        inner = self.model
        h = inner.embed_tokens(inputs)
        if cache is not None and inputs.shape[1] > 1:
            self.check_kernels(h.dtype)
        at = self._attention_at
        attn_mask: Mask = None
        if at is not None:
            attn_mask = self._masks(inputs.shape[1], None if cache is None else [cache[at]], mask)[0]
        last = len(inner.layers) - 1
        for i, layer in enumerate(inner.layers):
            c = None if cache is None else cache[i]
            h = layer(h, attn_mask, c, last_only and i == last)
            if c is not None:
                after_layer(h, c)
        return self.output(h[:, -1:] if last_only else h)

    def check_kernels(self, dtype: Any) -> None:
        """Run the decode kernel's one-time check: at load (the loader calls this on its thread
        with the compute dtype) and again at prefill, before any layer is built, where the verdict
        is then known. Never inside a compiled step's trace, nor between the layers the evaluation
        thread runs (whose stream the check's arrays would not be on)."""
        for layer in self.layers:
            if layer.is_linear:
                kernels.ready(layer.linear_attn.kernel_dims(), dtype, _ops_one_token)
                return  # every linear layer has the same shape

    def output(self, h: Array) -> Array:
        """Hidden states after the last layer -> logits (the final norm and the head)."""
        inner = self.model
        h = inner.norm(h)
        return inner.embed_tokens.as_linear(h) if self.lm_head is None else self.lm_head(h)

    def make_cache(self, context_len: int | None = None) -> list[Any]:
        """A RecurrentCache per linear layer (fixed size: `context_len` does not bound it), the
        attention layers' caches as any full-attention layer's."""
        attn = iter(make_layer_caches([None] * self.args.num_hidden_layers, context_len))
        return [RecurrentCache() if layer.is_linear else next(attn) for layer in self.layers]

    def sanitize(self, weights: dict[str, Array]) -> dict[str, Array]:
        weights = {k: v for k, v in weights.items() if not k.startswith(("mtp.", "model.mtp."))}
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return to_mlx_layout(weights, self.args.num_hidden_layers, self.args.num_experts)


def to_mlx_layout(weights: dict[str, Array], num_layers: int, num_experts: int) -> dict[str, Array]:
    """HF layout -> mlx-lm's: experts stacked, conv weights [C, 1, K] -> [C, K, 1], and (only for
    an HF checkpoint, told by its conv layout) the offset RMSNorm weights + 1."""
    hf = any("conv1d.weight" in k and v.ndim == 3 and v.shape[-1] != 1 for k, v in weights.items())
    weights = stack_experts(weights, num_layers, num_experts)
    for k, v in list(weights.items()):
        if "conv1d.weight" in k and v.ndim == 3 and v.shape[-1] != 1:
            weights[k] = mx.moveaxis(v, 2, 1)
        elif hf and k.endswith(NORM_SUFFIXES) and v.ndim == 1:
            weights[k] = v + 1.0
    return weights


__all__ = ["ModelArgs", "Model", "GatedDeltaNet", "Attention", "SparseMoeBlock", "DecoderLayer", "to_mlx_layout"]
