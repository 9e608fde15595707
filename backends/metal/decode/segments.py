"""The segmented decode step of the Llama family: compiled segments between the attentions, and
attention itself on exact-length keys through MLX's fused kernel.

The whole-step graph of `decoder.py` attends over fixed-size rings with an additive mask. MLX's
CUDA decode kernels take no array mask, so there every layer's attention runs as MLX's unfused
fallback (scale, matmul, mask, softmax, matmul): four kernels more per layer than mlx-lm, which
attends over the exact keys. This step keeps the fused kernel: per token it calls

    first: embedding, layer 0's norm and q/k/v projections with RoPE          (compiled)
    then for each layer i: write k, v at the position (static slice update), attend over the
    keys so far (a view, no mask), and
    mid:  layer i's o_proj, residual, MLP, residual, and layer i+1's norm, q/k/v and RoPE  (compiled)
    last: the last layer's o_proj, residual, MLP, residual, final norm, head, greedy pick  (compiled)

One trace of `mid` serves every layer (the weights are inputs), so a model is traced three times.
The q/k/v projections of a block, and its gate/up projections, run as one matmul each: at the first
segmented generation their weights are concatenated into one array and the projections keep views
of it (no extra memory; `fuse()`), two and one kernels fewer per layer. A projection given a new
weight since (an update, an adapter) is seen at the next generation and fused again (or, wrapped in
LoRA, run on its own).
On CUDA each residual add and the RMSNorm after it run as one kernel (`kernels/add_rms_norm.py`, bit-identical
to MLX's two; `PYMLXC_FUSED_NORM`): a plan decides once, and its segments trace with or without it.
Likewise each layer's RoPE and its key/value writes (`kernels/rope_kv.py`, `PYMLXC_CUDA_ROPE_KV`): the
segments then hand it the fused q/k/v projection's output as it comes (the joint q/k heads and v
where v is projected apart or Qwen 3 normalizes q and k), and the kernel writes the session's
private buffers in place.
Where each layer's attention can run as `kernels/decode_attention.py`'s CUDA kernels (they read the
position on the device), the first, middle and last segments and those kernels are traced as one
graph, `_trace_whole`, and a step is one call (`PYMLXC_CUDA_DECODE_ATTENTION`). Where the paired
4-bit kernel passes its check, each block's gate/up product and SiLU product are one kernel
(`FusedProjection.silu_product`, `PYMLXC_CUDA_GATE_UP`). Where the matvec kernel's residual and
normalized forms pass their check (and the model is small enough for `auto`), each residual add runs
inside the o_proj / down_proj product and each block norm inside the q/k/v / gate/up product that
follows it (`_finish_block_in_products`, `PYMLXC_CUDA_MATVEC_FUSION`): the segments then carry h
and never the normalized activations.
The segments run the model's own block in halves (`llama.Attention.heads` before the attention
step, `Attention.output` and `TransformerBlock.finish` after it): a model opts in by declaring
`segmented_decode` (llama.Model does, so Mistral, Qwen 2 and Qwen 3 and any architecture built on
its blocks follow), and `plan()` takes it where every layer attends fully (LoRA-wrapped
projections are fine: they are called as modules). The tests compare its tokens with the
uncompiled loop's for every architecture that declares it. Selected with `PYMLXC_DECODE=segmented`;
see `decoder.py` for the rest.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core.transforms import FixedArrays

from .. import nn
from ..kernel_choice import (
    FUSION_MAX_BYTES_PER_LAYER,
    fusion_ready,
    normed_product,
    normed_rope_product,
    pair_ready,
    quantized_matmul,
    residual_product,
    rope_fusion_ready,
    rope_takes,
)
from ..kernel_choice import silu_product as kernel_silu_product
from ..kernels import add_rms_norm as norm_kernel
from ..kernels import argmax as argmax_kernel
from ..kernels import check as kernel_check
from ..kernels import decode_attention as attention_kernel
from ..kernels import rope_kv as rope_kv_kernel
from ..models import llama
from ..models.base import RoPE
from ..nn import Module, arrays_of
from ..sample import greedy
from ..step_queue import StepQueue
from .rings import Rings, give_back, take_buffers
from .trace import CompileUnavailable, call_traced, clone_modules
from .trace import spec as traced_spec

_sdpa = mx.fast.scaled_dot_product_attention


def plan(model: Any) -> list[llama.TransformerBlock] | None:
    """The blocks of a model whose decode step can be segmented, else None: the model declares
    `segmented_decode` (its blocks run in halves: `llama.TransformerBlock` with a `llama.Attention`
    and a `llama.MLP`, or subclasses) and every layer attends fully."""
    if not nn.segmented_decode_applies(model):
        return None
    blocks = list(model.layers)
    for block in blocks:
        if (not isinstance(block, llama.TransformerBlock) or not isinstance(block.self_attn, llama.Attention)
                or not isinstance(block.mlp, llama.MLP)):
            return None
    return blocks or None


def use_fused_norm(model: Any, blocks: Sequence[Any], setting: str) -> bool:
    """Whether the segments of `model` add and normalize in one kernel (`kernels/add_rms_norm.py`): `setting`
    (PYMLXC_FUSED_NORM: auto = on CUDA, 1 = also elsewhere, where the kernel then fails its check,
    or 0) allows it, every norm after a residual is an RMSNorm of a shape and type the kernel takes, and
    the kernel passes its check on this machine."""
    if setting == "0" or (setting == "auto" and not kernel_check.on_cuda()):
        return False
    norms = [b.post_attention_layernorm for b in blocks] + [b.input_layernorm for b in blocks[1:]] + [model.model.norm]
    if any(type(n) is not nn.RMSNorm for n in norms):
        return False
    return norm_kernel.serves([n.weight for n in norms], [n.eps for n in norms])


def use_cuda_argmax(model: Any, setting: str) -> bool:
    """Whether the last segment's greedy argmax runs as `kernels/argmax.py`'s kernels: `setting`
    (PYMLXC_CUDA_ARGMAX: auto = on CUDA, 1 = also elsewhere, where the kernels then fail their
    check, or 0) allows it, the logits are of a floating type, and the kernels pass their check."""
    if setting == "0" or (setting == "auto" and not kernel_check.on_cuda()):
        return False
    embed = model.model.embed_tokens
    head = model.lm_head if model.lm_head is not None else embed
    dtype = getattr(head, "scales", head.weight).dtype  # a quantized head's outputs take its scales' type
    if not dtype.is_floating:  # GGUF blocks (uint8): dequantized in the activations' dtype
        dtype = model.compute_dtype
    vocab = head.weight.shape[0]
    return argmax_kernel.applies(dtype) and argmax_kernel.check(vocab, dtype)


def use_rope_kv(model: Any, blocks: Sequence[Any], fusions: Sequence[tuple[Fusion | None, Fusion | None]] | None,
                setting: str) -> rope_kv_kernel.Rope | None:
    """The RoPE for `kernels/rope_kv.py`'s kernel where each layer's RoPE and key/value writes run as
    that kernel, else None: `setting` (PYMLXC_CUDA_ROPE_KV: auto = on CUDA, 1 = also elsewhere,
    where the kernel then fails its check, or 0) allows it, every block's q/k/v projections are
    fused (the kernel takes the joint q and k heads; Qwen3's norms joined too), all layers share
    one RoPE the kernel reproduces and one head layout, and the kernel passes its check."""
    if setting == "0" or (setting == "auto" and not kernel_check.on_cuda()) or not fusions:
        return None
    attns = [b.self_attn for b in blocks]
    joint = [f[0].fused for f in fusions if f[0] is not None]
    if len(joint) != len(attns) or any(a.qk_norms() and f.qk_norm_weight is None
                                       for a, f in zip(attns, joint, strict=True)):
        return None
    first = attns[0]
    shape = (first.n_heads, first.n_kv_heads, first.head_dim)
    ropes = [rope_of(a.rope, a.head_dim) for a in attns]
    if (ropes[0] is None or any(r is None or r.key != ropes[0].key for r in ropes)
            or any((a.n_heads, a.n_kv_heads, a.head_dim) != shape for a in attns)):
        return None
    dtype = model.compute_dtype  # the hidden states' type, set at load (a GGUF embedding may be uint8 blocks)
    hq, hkv, d = shape
    return ropes[0] if rope_kv_kernel.check(dtype, hq, hkv, d, d, ropes[0], first.rope) else None


def use_pair_silu(fusions: Sequence[tuple[Fusion | None, Fusion | None]] | None, setting: str) -> bool:
    """Whether each block's gate/up product and the SiLU product after it run as one CUDA kernel
    (`FusedProjection.silu_product`): `setting` (PYMLXC_CUDA_GATE_UP: auto = on CUDA, 1 = also
    elsewhere, where the kernel then fails its check, or 0) allows it, every gate/up fusion is 4-bit
    on pymlxc's matvec kernel with halves of one size, and the paired kernel passes its check."""
    if setting == "0" or (setting == "auto" and not kernel_check.on_cuda()) or not fusions:
        return False
    fused = [f[1].fused for f in fusions if f[1] is not None]
    kinds = {f.pairable() for f in fused}
    kind = next(iter(kinds)) if len(kinds) == 1 and len(fused) == len(fusions) else None
    return kind is not None and pair_ready(*kind)


def use_matvec_fusion(model: Any, blocks: Sequence[Any], fusions: Sequence[tuple[Fusion | None, Fusion | None]] | None,
                      pair_silu: bool, setting: str,
                      layers: Layers | None = None) -> str:
    """Which residual adds and block RMSNorms run inside the 4-bit products (the matvec kernel's
    residual and normalized forms, `kernel_choice.residual_product` / `normed_product`): "all" (the
    adds inside o_proj and down_proj, the norms inside q/k/v and gate/up), "ends" (the q/k/v norm
    and down_proj's add only: every block of the normalized form normalizes h again, which the wide
    gate/up product of a large model pays more for than the kernel it saves) or "" (none).
    `setting` (PYMLXC_CUDA_MATVEC_FUSION: auto = on CUDA, "all" for models of at most
    FUSION_MAX_BYTES_PER_LAYER of 4-bit layers a block and "ends" above; 1 = "all" at any size and
    also elsewhere, where the check then fails; ends; or 0) allows it, the gate/up products are
    paired (`pair_silu`), every block norm is an RMSNorm of the model's type, at least one layer
    can take a form (`fused_layers`, or `layers` where the caller has them: a GGUF file's Q6_K layers
    cannot, the others still do), and the forms pass their check for each group size and eps of
    those layers."""
    if setting == "0" or (setting == "auto" and not kernel_check.on_cuda()) or not fusions or not pair_silu:
        return ""
    mode = "ends" if setting == "ends" else "all"
    # Dense linears on the kernel count as the 4-bit bytes of as many weights (the bound is in weights).
    dense_weights = sum(m.weight.size for m in nn.block_linears(model) if m.cuda_matvec) / max(1, len(blocks))
    if setting == "auto" and nn.bytes_per_block(model, [m for m in nn.quantized_layers(model) if m.bits == 4]
                                                ) + dense_weights / 2 > FUSION_MAX_BYTES_PER_LAYER:
        mode = "ends"
    dtype = model.compute_dtype
    norms = [n for b in blocks for n in (b.input_layernorm, b.post_attention_layernorm)]
    if any(type(n) is not nn.RMSNorm or n.weight.dtype != dtype for n in norms):
        return ""
    heads, ends = layers if layers is not None else fused_layers(model, blocks, fusions)
    ends = ends_in(mode, ends)
    if not any(heads) and not any(ends):
        return ""
    groups = ({_weights(m)[3] for b, end in zip(blocks, ends, strict=True) if end
               for m in (b.self_attn.o_proj, b.mlp.down_proj)[:2 if end == END_BOTH else 1]}
              | {kind[1] for f, head in zip(fusions, heads, strict=True) if head
                 and f[0] is not None and (kind := f[0].fused.normable()) is not None})
    d = norms[0].weight.shape[0]
    ready = all(fusion_ready(dtype, g, d, eps) for g in sorted(groups) for eps in sorted({float(n.eps) for n in norms}))
    return mode if ready else ""


def _on_kernel(m: Any, dtype: Any) -> bool:
    """A linear pymlxc's matvec kernel computes in `dtype`, without a bias: 4-bit, or dense of that
    type (`nn.choose_dense_matvec`)."""
    if m.__dict__.get("bias") is not None:
        return False
    if type(m) is nn.Linear:
        return m.cuda_matvec and m.weight.dtype == dtype
    return type(m) is nn.QuantizedLinear and m.cuda_matvec and m.bits == 4 and m.scales.dtype == dtype


def _weights(m: Any) -> tuple[Array, Array | None, Array | None, int]:
    """(weight, scales, biases, group size) of a linear as the forms take them and their checks key
    them: scales and biases None and group 0 for dense weights."""
    if type(m) is nn.Linear:
        return m.weight, None, None, 0
    return m.weight, m.scales, m.biases, m.group_size


# A block's end in the products' forms (`fused_layers`): "" none; END_O o_proj's residual form and
# the normalized gate/up product, down_proj apart (its own product, then MLX's add or the add + norm
# kernel); END_BOTH down_proj's residual form too.
END_O = "o"
END_BOTH = "o+down"
Layers = tuple[tuple[bool, ...], tuple[str, ...]]


def ends_in(mode: str, ends: tuple[str, ...]) -> tuple[str, ...]:
    """The block ends `fused_layers` allows, as the plan's `matvec_fusion` `mode` takes them: "ends"
    has no normalized gate/up product, so END_O's blocks keep MLX's add + norm there ("")."""
    return tuple(e if mode == "all" or e == END_BOTH else "" for e in ends)


def fused_layers(model: Any, blocks: Sequence[Any], fusions: Sequence[tuple[Fusion | None, Fusion | None]]
                 ) -> Layers:
    """Per block, whether its q/k/v product can take the normalized form (a fusion without a tail,
    4-bit on pymlxc's kernel in the model's type; q and k norms joined to it where the block has
    them) and how much of its end can take the residual forms: END_BOTH where o_proj and down_proj
    are 4-bit on the kernel in that type, without a bias, and the gate/up product is paired; END_O
    where only o_proj is (a GGUF Q4_K_M file's layers whose down projections are Q6_K blocks: their
    o_proj still adds the residual and their gate/up product still normalizes); else ""."""
    dtype = model.compute_dtype
    heads = []
    ends = []
    for block, (qkv, gate_up) in zip(blocks, fusions, strict=True):
        kind = qkv.fused.normable() if qkv is not None else None
        heads.append(kind is not None and kind[0] == dtype
                     and not (block.self_attn.qk_norms() and qkv is not None and qkv.fused.qk_norm_weight is None))
        paired = gate_up is not None and gate_up.fused.pairable() is not None
        o_end = paired and _on_kernel(block.self_attn.o_proj, dtype)
        ends.append("" if not o_end else END_BOTH if _on_kernel(block.mlp.down_proj, dtype) else END_O)
    return tuple(heads), tuple(ends)


def use_rope_in_product(model: Any, blocks: Sequence[Any],
                        fusions: Sequence[tuple[Fusion | None, Fusion | None]] | None,
                        rope: rope_kv_kernel.Rope | None, matvec_fusion: str, setting: str) -> bool:
    """Whether each layer's RoPE and key/value writes run inside its normalized q/k/v product (the
    matvec kernel's RoPE form, `kernel_choice.normed_rope_product`) instead of as
    `kernels/rope_kv.py`'s kernel after it: `setting` (PYMLXC_CUDA_ROPE_IN_PRODUCT: auto = with
    `matvec_fusion`, or 0) allows it, the plan has both the normalized products (`matvec_fusion`)
    and the RoPE kernel (`rope`), no block normalizes q and k (Qwen 3) or adds a q/k/v bias, and
    the form passes its check for each group size and eps."""
    if setting == "0" or not matvec_fusion or rope is None or not fusions:
        return False
    attns = [b.self_attn for b in blocks]
    joint = [f[0].fused for f in fusions if f[0] is not None]
    if any(a.qk_norms() for a in attns) or any(f.has_bias for f in joint):
        return False
    first = attns[0]
    dtype = model.compute_dtype
    norms = [b.input_layernorm for b in blocks]
    d = norms[0].weight.shape[0]
    groups = sorted({kind[1] for f in joint if (kind := f.normable()) is not None})
    return all(rope_fusion_ready(dtype, g, d, eps, first.n_heads, first.n_kv_heads, first.head_dim, rope)
               for g in groups for eps in sorted({float(n.eps) for n in norms}))


def use_decode_attention(model: Any, blocks: Sequence[Any], rope: rope_kv_kernel.Rope | None, setting: str
                         ) -> str | None:
    """How the whole step runs as one graph (`_trace_whole`), or None to keep the segments:
    "kernel" where `setting` (PYMLXC_CUDA_DECODE_ATTENTION: auto = on CUDA, 1 = everywhere, or 0)
    allows it, the plan writes the keys with the RoPE kernel (the position is then on the device),
    every layer has one head layout MLX's one-token kernels take, and `kernels/decode_attention.py`
    passes its check; with `1` elsewhere "mlx" (MLX's attention over the whole buffer, masked: the
    same tokens, for machines without the kernels)."""
    if setting == "0" or (setting == "auto" and not kernel_check.on_cuda()):
        return None
    attns = [b.self_attn for b in blocks]
    first = attns[0]
    shape = (first.n_heads, first.n_kv_heads, first.head_dim)
    dtype = model.compute_dtype
    alike = all((a.n_heads, a.n_kv_heads, a.head_dim) == shape for a in attns)
    if (rope is not None and kernel_check.on_cuda() and alike
            and attention_kernel.applies(dtype, *shape, first.head_dim)
            and all(attention_kernel.check(dtype, *shape, scale) for scale in sorted({float(a.scale) for a in attns}))):
        return "kernel"
    return "mlx" if setting == "1" else None


# ---------------------------------------------------------------------- fused projections

def rope_of(module: Any, head_dim: int) -> rope_kv_kernel.Rope | None:
    """The RoPE + cache-write kernel's form of a block's `models.base.RoPE` (exactly that class:
    a subclass may rotate differently); None where the kernel cannot reproduce it."""
    if type(module) is not RoPE:
        return None
    return rope_kv_kernel.rope_table(dims=module.dims, traditional=module.traditional, base=module.base,
                                     scale=module.scale,
                                     freqs=module._freqs,  # noqa: SLF001 - the module's constant, read-only
                                     head_dim=head_dim)


class FusedProjection(Module):
    """Linears of one input as one matmul: the concatenated weight (dense: its transpose) and,
    quantized, the concatenated scales and biases; `__call__` gives each linear's output."""

    def __init__(self, sizes: Sequence[int], *, weight_t: Array | None = None, weight: Array | None = None,
                 scales: Array | None = None, biases: Array | None = None, bias: Array | None = None,
                 group_size: int = 0, bits: int = 0, cuda_matvec: bool = False, tail: Any = None) -> None:
        super().__init__()
        self._sizes = tuple(sizes)
        self._wT, self._weight, self._scales, self._biases, self._bias = weight_t, weight, scales, biases, bias
        self._group_size, self._bits, self._cuda_matvec = group_size, bits, cuda_matvec
        # Qwen3's q and k norms as one (see `joint_qk_norm`): the weights [q heads + k heads, 1, D].
        self.qk_norm_weight: Array | None = None
        self.qk_norm_eps = 0.0
        # A linear applied apart, its output last (`fuse`'s `tail`); private: the model holds it.
        self._tail = tail
        # [gate; up] whose product and SiLU product run as one CUDA kernel (`silu_product`): set on a
        # trace's own copy where the decode plan chose it (`SegmentGroup.pair_silu`), never here.
        self.pair_silu = False

    @property
    def tail(self) -> Any:
        """The linear applied apart (a model's layer: any Module with `__call__`), or None."""
        return self._tail

    @property
    def dense(self) -> bool:
        """Whether the fused linears are dense (nn.Linear), not quantized."""
        return self._wT is not None

    @property
    def quantized_weights(self) -> bool:
        """Whether the fused linears are quantized (`quantized()` gives their weights)."""
        return self._wT is None and self._weight is not None and self._scales is not None

    def quantized(self) -> tuple[Array, Array, Array, int, int]:
        """The quantized fused weight: (packed weight, scales, biases, group size, bits)."""
        assert self._weight is not None and self._scales is not None and self._biases is not None
        return self._weight, self._scales, self._biases, self._group_size, self._bits

    @property
    def sizes(self) -> tuple[int, ...]:
        """Each fused linear's output width, in the order of `joint`'s output (not the tail's)."""
        return self._sizes

    def joint(self, x: Array, norm: Any = None) -> Array:
        """The fused linears' outputs side by side on the last axis (one matmul; not the tail's).
        `norm`: x is the residual stream and the product normalizes it first with this RMSNorm
        (`kernel_choice.normed_product`; the plan checked `normable`)."""
        if norm is not None:
            assert self._weight is not None and self.normable() is not None  # the plan checked it
            y = normed_product(x, self._weight, self._scales, self._biases, self._group_size, norm.weight, norm.eps)
            return y if self._bias is None else y + self._bias
        weight, scales, biases = self._weight, self._scales, self._biases
        assert weight is not None  # given for either kind
        if self._wT is not None:  # as the linears compute it
            return nn.linear_product(x, weight, self._wT, self._bias, self._cuda_matvec)
        assert scales is not None and biases is not None  # given where weight_t is not
        if nn.dequantizing():
            given = nn.given_dense_product(self, x)
            y = given if given is not None else nn.dequantized_product(x, weight, scales, biases, self._group_size,
                                                                       self._bits)
            return y if self._bias is None else y + self._bias
        y = quantized_matmul(x, weight, scales, biases, self._group_size, self._bits, self._cuda_matvec)
        return y if self._bias is None else y + self._bias

    @property
    def has_bias(self) -> bool:
        return self._bias is not None

    def rope_product(self, h: Array, norm: Any, positions: Array, keys: Array, values: Array,
                     rope: rope_kv_kernel.Rope, n_heads: int) -> tuple[Array, Array, Array] | None:
        """(queries RoPE'd, keys, values) of the layer's step as the RoPE form of the normalized
        product (`kernel_choice.normed_rope_product`: the key and value written in place), or None
        where it does not take these arrays (the caller then projects and runs the RoPE kernel)."""
        weight, scales, biases = self._weight, self._scales, self._biases
        if (weight is None or self.normable() is None or self._bias is not None
                or not rope_takes(h, weight, scales, biases, self._group_size, keys, values, n_heads)):
            return None
        return normed_rope_product(h, weight, scales, biases, self._group_size, norm.weight, norm.eps, positions,
                                   keys, values, rope, n_heads)

    def normable(self) -> tuple[Any, int] | None:
        """(the scales' dtype, the group size) where pymlxc's 4-bit matvec kernel, plain or in its
        normalized form, computes this fusion's product (4-bit on that kernel, no tail); (the
        weight's dtype, 0) where its dense form does (`nn.choose_dense_matvec`); else None."""
        if self._weight is None or not self._cuda_matvec or self.tail is not None:
            return None
        if self._wT is not None:  # dense
            return self._weight.dtype, 0
        if self._scales is None or self._bits != 4:
            return None
        return self._scales.dtype, self._group_size

    def pairable(self) -> tuple[Any, int] | None:
        """`normable`'s (dtype, group size) where this fusion is also a gate/up pair the paired
        kernel can take (two halves of one size, no bias); else None."""
        if self._bias is not None or len(self._sizes) != 2 or self._sizes[0] != self._sizes[1]:
            return None
        return self.normable()

    def silu_product(self, x: Array, norm: Any = None) -> Array | None:
        """silu(gate) * up of a gate/up fusion as one kernel (`kernel_choice.silu_product`) where
        `pair_silu` is set and the kernel takes x (a few rows); else None: the caller computes it
        from `__call__`'s outputs. `norm`: x is the residual stream, normalized inside the kernel
        (`kernel_choice.normed_product`; the plan checked it)."""
        if not self.pair_silu or self.pairable() is None:
            return None
        assert self._weight is not None  # pairable
        if norm is not None:
            return normed_product(x, self._weight, self._scales, self._biases, self._group_size, norm.weight,
                                  norm.eps, pair=True)
        return kernel_silu_product(x, self._weight, self._scales, self._biases, self._group_size, self._bits,
                                   self._cuda_matvec)

    def __call__(self, x: Array) -> list[Array]:
        y = self.joint(x)
        outs, start = [], 0
        lead = list(y.shape[:-1])
        for n in self._sizes:
            outs.append(mx.slice(y, [0] * len(lead) + [start], [*lead, start + n], [1] * (len(lead) + 1)))
            start += n
        if self.tail is not None:
            outs.append(self.tail(x))
        return outs


@runtime_checkable
class _Norm(Protocol):
    """An RMS norm as `_join_qk_norms` reads it."""

    weight: Array
    eps: float


@dataclass
class Fusion:
    """A FusedProjection and the arrays it gave its linears (to see whether they still hold them)."""

    fused: FusedProjection
    linears: tuple[Module, ...]
    given: tuple[tuple[Array | None, ...], ...]

    def valid(self) -> bool:
        return all(_held(m) == g for m, g in zip(self.linears, self.given, strict=True))


def _held(m: Module) -> tuple[Any, ...]:
    d = m.__dict__
    return tuple(id(d.get(k)) for k in ("weight", "scales", "biases", "bias"))


def fuse(linears: Sequence[Module], qk_norms: Sequence[Module] = (), tail: Module | None = None) -> Fusion | None:
    """Concatenate the weights of `linears` (all nn.Linear, or all nn.QuantizedLinear of one
    format; biases on all or none) into one array and give each linear a view of its rows.
    `qk_norms`: the q and k RMSNorms after q/k/v projections (Qwen3), joined too where they can be.
    `tail`: a last linear that stays apart, its output after theirs (a GGUF value projection in
    another type than q and k, as llama.cpp's K-quant recipes make it: q and k still run as one)."""
    kinds = {type(m) for m in linears}
    if len(linears) < 2 or len(kinds) != 1 or kinds.pop() not in (nn.Linear, nn.QuantizedLinear):
        return None
    # All of them (one exact type, checked above); the lists narrow the type for the checker.
    layers = [m for m in linears if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    quantized = [m for m in layers if isinstance(m, nn.QuantizedLinear)]
    with_bias = [m.__dict__.get("bias") is not None for m in linears]
    if any(with_bias) and not all(with_bias):
        return None
    sizes = [m.weight.shape[0] for m in layers]
    bias = mx.concatenate([m.bias for m in layers], axis=0) if with_bias[0] else None
    if not quantized:
        weight = mx.concatenate([m.weight for m in layers], axis=0)
        parts = {"weight": weight}
        # The weight itself too: pymlxc's dense kernel reads its rows (where the linears take it).
        fused = FusedProjection(sizes, weight_t=mx.transpose(weight), weight=weight, bias=bias,
                                cuda_matvec=all(m.cuda_matvec for m in layers), tail=tail)
    else:
        if len({(m.group_size, m.bits, m.scales.dtype) for m in quantized}) != 1:
            return None
        parts = {k: mx.concatenate([getattr(m, k) for m in quantized], axis=0) for k in ("weight", "scales", "biases")}
        fused = FusedProjection(sizes, weight=parts["weight"], scales=parts["scales"], biases=parts["biases"],
                                bias=bias, group_size=quantized[0].group_size, bits=quantized[0].bits,
                                cuda_matvec=all(m.cuda_matvec for m in quantized), tail=tail)
    if bias is not None:
        parts["bias"] = bias
    mx.eval(list(parts.values()))
    start = 0
    for m, n in zip(linears, sizes, strict=True):
        for name, whole in parts.items():
            setattr(m, name, whole[start:start + n])  # a view of the rows: no copy
        start += n
    if qk_norms:
        _join_qk_norms(fused, qk_norms, sizes)
    mx.eval([a for m in linears for a in m.arrays()] + list(fused.arrays()))
    # A norm or the tail given new weights remakes the fusion too.
    held = (*linears, *qk_norms, *([tail] if tail is not None else []))
    return Fusion(fused, held, tuple(_held(m) for m in held))


def _join_qk_norms(fused: FusedProjection, norms: Sequence[Module], sizes: Sequence[int]) -> None:
    """Give `fused` the q and k norms' weights side by side, one row per head, where both norms
    have one eps and one dtype (else it keeps none and the norms run apart)."""
    q_norm, k_norm = norms
    if not (isinstance(q_norm, _Norm) and isinstance(k_norm, _Norm)):
        return  # a norm without one weight and one eps cannot be joined
    d = q_norm.weight.shape[0]
    if q_norm.eps != k_norm.eps or q_norm.weight.dtype != k_norm.weight.dtype or k_norm.weight.shape[0] != d:
        return
    rows = [mx.broadcast_to(mx.reshape(n.weight, (1, 1, d)), (size // d, 1, d))
            for n, size in zip((q_norm, k_norm), sizes[:2], strict=True)]
    fused.qk_norm_weight = mx.concatenate(rows, axis=0)
    fused.qk_norm_eps = q_norm.eps


def fusions_for(blocks: Sequence[Any], known: dict[int, tuple[Any, Fusion | None, Fusion | None]]
                ) -> list[tuple[Fusion | None, Fusion | None]]:
    """Each block's (q/k/v, gate/up) fusion, made or remade where the linears changed since."""
    out = []
    for block in blocks:
        attn, mlp = block.self_attn, block.mlp
        norms = attn.qk_norms()
        groups = ((attn.q_proj, attn.k_proj, attn.v_proj, *norms), (mlp.gate_proj, mlp.up_proj))
        entry = known.get(id(block))
        if entry is not None and entry[0] is block and all(
                f is not None and f.linears == g and f.valid() for f, g in zip(entry[1:], groups, strict=True)):
            out.append((entry[1], entry[2]))
            continue
        qkv = fuse(groups[0][:3], norms) or fuse(groups[0][:2], norms, tail=attn.v_proj)
        gate_up = fuse(groups[1])
        known[id(block)] = (block, qkv, gate_up)
        out.append((qkv, gate_up))
    return out


# ---------------------------------------------------------------------- the segments (traced)

def _project(attn: Any, x: Array, pos: Array, qkv: FusedProjection | None, rope_kv: bool = False,
             norm: Any = None) -> list[Array]:
    """q, k, v [B, heads, 1, D] of one token, as the attention's `heads` makes them, RoPE'd at `pos`;
    with `rope_kv` (the plan checked the fusions) [joint q and k heads before RoPE, v], or [the fused
    q/k/v output as it comes] where v is part of it, for `kernels/rope_kv.py`'s kernel. `norm`: x
    is the residual stream, which the fused product normalizes with it (the plan's `matvec_fusion`)."""
    qk_norm = bool(attn.qk_norms())
    if norm is not None:  # use_matvec_fusion checked every fusion: the branch below takes them
        assert qkv is not None and qkv.tail is None and (not qk_norm or qkv.qk_norm_weight is not None)
    if qkv is not None and (not qk_norm or qkv.qk_norm_weight is not None):
        # One RoPE call for q and k: their heads are adjacent in the joint output [B, 1, heads * D].
        b = x.shape[0]
        hq, hkv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
        if qkv.tail is not None:  # v apart: q and k are the joint output
            qk = mx.reshape(qkv.joint(x), (b, hq + hkv, 1, d))
            v = mx.reshape(qkv.tail(x), (b, hkv, 1, d))
        elif rope_kv and not qk_norm:
            return [qkv.joint(x, norm)]  # the kernel reads the heads where they are: no views in the graph
        else:
            qk, v = rope_kv_kernel.split_joint(qkv.joint(x, norm), hq, hkv, d)
        if qk_norm:
            qk = joint_qk_norm(qk, qkv)
        if rope_kv:
            return [qk, v]
        qk = attn.rope(qk, pos)
        return [mx.slice(qk, [0, 0, 0, 0], [b, hq, 1, d], [1, 1, 1, 1]),
                mx.slice(qk, [0, hq, 0, 0], [b, hq + hkv, 1, d], [1, 1, 1, 1]), v]
    q, k, v = attn.heads(x, qkv, one_token=True)
    return [attn.rope(q, pos), attn.rope(k, pos), v]


def joint_qk_norm(qk: Array, qkv: FusedProjection) -> Array:
    """Qwen3's q and k norms over the joint heads [B, q + k heads, 1, D]: a weightless RMSNorm, then
    the joint weights. Bit for bit the two weighted norms: MLX's weighted kernel also rounds the
    normalized value to the array's type before it multiplies by the weight in that type (read in
    MLX's rms_norm kernels), and each row's sum runs alike. Two kernels instead of two norms and a
    second RoPE."""
    weight = qkv.qk_norm_weight
    assert weight is not None  # called only where the norms were joined
    return mx.fast.rms_norm(qk, None, qkv.qk_norm_eps) * weight


def _add_norm(h: Array, out: Array, norm: Any, fused: bool) -> tuple[Array, Array]:
    """(h + out, norm(h + out)): one CUDA kernel when `fused` (`kernels/add_rms_norm.py`), else MLX's two."""
    if fused and h.dtype == out.dtype == norm.weight.dtype:
        both: tuple[Array, Array] = norm_kernel.add_rms_norm(h, out, norm.weight, norm.eps)
        return both
    h = h + out
    return h, norm(h)


def _finish_block(group: SegmentGroup, block: Any, attn_out: Array, h: Array, gate_up: FusedProjection | None
                  ) -> tuple[Array, Array]:
    """The block after its attention (its own `finish`): (h after the attention's residual, the
    MLP's output). The caller adds the two, with the norm that follows. `gate_up` is the trace's
    copy, which takes the group's choice of the paired gate/up kernel."""
    fused_norm = group.fused_norm
    if gate_up is not None:
        gate_up.pair_silu = group.pair_silu
    o = block.self_attn.output(attn_out, one_token=True)  # [B, heads, 1, D]: one token, no transpose
    both: tuple[Array, Array] = block.finish(h, o, gate_up, lambda x, out, norm: _add_norm(x, out, norm, fused_norm))
    return both


def _o_and_normed_pair(block: Any, attn_out: Array, h: Array, gate_up: FusedProjection | None
                       ) -> tuple[Array, Array]:
    """(h + o_proj(attn_out) as o_proj's residual form, silu(gate) * up of its norm as the normalized
    pair): a block end's first two kernels with "all" (END_O and END_BOTH)."""
    assert gate_up is not None  # fused_layers checked the fusion
    gate_up.pair_silu = True
    h = residual_product(llama.one_token_rows(attn_out), *_weights(block.self_attn.o_proj), h)
    product = gate_up.silu_product(h, block.post_attention_layernorm)
    assert product is not None  # paired (the plan's pair_silu)
    return h, product


def _finish_block_o_in_product(block: Any, attn_out: Array, h: Array, gate_up: FusedProjection | None
                               ) -> tuple[Array, Array]:
    """A block of END_O after its attention: (h after o_proj's residual form, down of the normalized
    pair), as `_finish_block` returns them, for the caller's add (down_proj is not on the kernel)."""
    h, product = _o_and_normed_pair(block, attn_out, h, gate_up)
    return h, block.mlp.down_proj(product)


def _finish_block_in_products(group: SegmentGroup, block: Any, attn_out: Array, h: Array,
                              gate_up: FusedProjection | None) -> Array:
    """The block after its attention with the residual adds and the MLP's norm inside the products
    (the plan's `matvec_fusion`): h + o_proj(attn_out), then that plus down(silu(gate) * up of its
    norm): the block's output, which the next product normalizes itself. Three kernels; with the
    plan's `matvec_fusion` "ends" four: o_proj, the add + norm kernel, the plain gate/up pair and
    the residual down_proj."""
    attn, mlp = block.self_attn, block.mlp
    if group.matvec_fusion == "ends":
        assert gate_up is not None  # use_matvec_fusion checked the fusions
        gate_up.pair_silu = True
        h, normed = _add_norm(h, attn.output(attn_out, one_token=True), block.post_attention_layernorm,
                              group.fused_norm)
        product = gate_up.silu_product(normed)
        if product is None:  # the kernel does not take these rows: MLX's products and SiLU
            out: Array = h + mlp(normed, gate_up)
            return out
    else:
        h, product = _o_and_normed_pair(block, attn_out, h, gate_up)
    return residual_product(product, *_weights(mlp.down_proj), h)


def _heads(group: SegmentGroup, attn: Any, x: Array, positions: Array, qkv: FusedProjection | None,
           kv_inputs: list[Array], norm: Any = None) -> list[Array]:
    """The layer's [q, k, v] RoPE'd; with the plan's RoPE kernel [q RoPE'd, keys, values], its key
    and value written into the buffers `kv_inputs` [keys, values, RoPE table] (in place:
    the same buffers come back). `positions`: the step's position, as the session carries it."""
    # MLX's ops take the scalar; the kernel reads the first element of the carried array itself, and
    # on its path the trace holds no view (an unused one is not part of the compiled graph).
    if group.rope_in_product and norm is not None and qkv is not None:
        keys, values, table = kv_inputs
        done = qkv.rope_product(x, norm, positions, keys, values, dataclasses.replace(group.rope, table=table),
                                attn.n_heads) if group.rope is not None else None
        if done is not None:
            return list(done)
    pos = rope_kv_kernel.scalar_position(positions) if group.rope is not None else positions
    heads = _project(attn, x, pos, qkv, group.rope is not None, norm)
    if group.rope is None:
        return heads
    keys, values, table = kv_inputs
    qk, v = heads if len(heads) == 2 else (heads[0], None)
    if {h.dtype for h in heads} != {keys.dtype} or values.dtype != keys.dtype:
        # The kernel writes the heads' type into the buffers: where they differ (caches filled in
        # another type than the step computes in, say), MLX's RoPE and casting updates do it.
        return list(rope_kv_kernel.reference(qk, v, pos, keys, values, attn.rope, attn.n_heads))
    rope = dataclasses.replace(group.rope, table=table)
    return list(rope_kv_kernel.rope_write_kv(qk, v, positions, keys, values, rope, attn.n_heads))


# With the RoPE kernel the step's position travels between the segments as int32 [POSITION_WIDTH]
# (every element the position), else as a scalar. MLX's CUDA allocator keeps arrays of 8 bytes or
# less in managed memory the host reads at once, and every layer's RoPE kernel then read the scalar
# at about PCIe latency; 16 bytes come from device memory.
POSITION_WIDTH = 4


def _first_body(group: SegmentGroup, mods: list[Any], tokens: Array, pos: Array, kv: list[Array]) -> list[Array]:
    """The first segment: [*layer 0's heads (`_heads`), h]."""
    embed, norm, attn, qkv = mods
    h = embed(mx.reshape(tokens, (tokens.shape[0], 1)))
    if group.heads_in_product:
        return [*_heads(group, attn, h, pos, qkv, kv, norm), h]
    return [*_heads(group, attn, norm(h), pos, qkv, kv), h]


def _mid_body(group: SegmentGroup, mods: list[Any], attn_out: Array, h: Array, pos: Array, kv: list[Array]
              ) -> list[Array]:
    """A middle segment: layer i after its attention, then [*layer i+1's heads, h]. Each half takes
    the products' residual and normalized forms where the group's flags say so (`fused_layers`)."""
    block, gate_up, norm, attn, qkv = mods
    x = None
    end = group.ends_in_products
    if end == END_BOTH:
        h = _finish_block_in_products(group, block, attn_out, h, gate_up)
    else:
        h, mlp_out = (_finish_block_o_in_product(block, attn_out, h, gate_up) if end == END_O
                      else _finish_block(group, block, attn_out, h, gate_up))
        if group.heads_in_product:
            h = h + mlp_out
        else:
            h, x = _add_norm(h, mlp_out, norm, group.fused_norm)
    if group.heads_in_product:
        return [*_heads(group, attn, h, pos, qkv, kv, norm), h]
    return [*_heads(group, attn, norm(h) if x is None else x, pos, qkv, kv), h]


def _last_body(group: SegmentGroup, mods: list[Any], attn_out: Array, h: Array) -> Array:
    """The last segment: the last layer after its attention, the final norm and the head; the
    sampled ids where greedy is fused, else the logits [B, V]."""
    block, gate_up, norm, embed, head = mods
    end = group.ends_in_products
    if end == END_BOTH:
        h = norm(_finish_block_in_products(group, block, attn_out, h, gate_up))
    else:
        h, mlp_out = (_finish_block_o_in_product(block, attn_out, h, gate_up) if end == END_O
                      else _finish_block(group, block, attn_out, h, gate_up))
        _, h = _add_norm(h, mlp_out, norm, group.fused_norm)
    logits = embed.as_linear(h) if group.tied else head(h)
    logits = mx.reshape(logits, (logits.shape[0], logits.shape[-1]))
    if group.fuse_greedy:
        logits = argmax_kernel.argmax(logits) if group.cuda_argmax else greedy(logits)
    return logits


def _trace_first(inputs: list[Array]) -> list[Array]:
    group: SegmentGroup = traced_spec()
    group.stats["traces"] += 1
    n = 2 + group.kv_inputs
    mods = clone_modules(group.modules, group.arrays, inputs[n:])
    return _first_body(group, mods, inputs[0], inputs[1], inputs[2:n])


def _trace_mid(inputs: list[Array]) -> list[Array]:
    group: SegmentGroup = traced_spec()
    n = 3 + group.kv_inputs
    mods = clone_modules(group.modules, group.arrays, inputs[n:])
    return _mid_body(group, mods, inputs[0], inputs[1], inputs[2], inputs[3:n])


def _trace_last(inputs: list[Array]) -> list[Array]:
    group: SegmentGroup = traced_spec()
    mods = clone_modules(group.modules, group.arrays, inputs[3:])
    return [_last_body(group, mods, inputs[0], inputs[1]), inputs[2] + 1]


def _whole_attention(plan: SegmentPlan, i: int, q: Array, keys: Array, values: Array, pos: Array, single: bool,
                     masks: dict[int, Array]) -> Array:
    """Layer i's attention inside the whole step: the CUDA kernels, which read the position on the
    device, or (`plan.attention == "mlx"`) MLX's attention over the whole buffer, slots past the
    position masked (`masks`: the step's masks by slot count, made once and shared by the layers)."""
    scale = plan.scales[i]
    if plan.attention == "kernel":  # flat [B, 1, heads * D], as o_proj takes it: no reshape node
        return attention_kernel.attend(q, keys, values, pos, scale, single, flat=True)
    slots = keys.shape[2]
    if slots not in masks:
        visible = mx.less_equal(mx.arange(slots, dtype=mx.int32), rope_kv_kernel.scalar_position(pos))
        masks[slots] = mx.reshape(visible, (1, 1, 1, slots))
    return _sdpa(q, keys, values, scale=scale, mask=masks[slots])


def _write_kv(plan: SegmentPlan, heads: list[Array], keys: Array, values: Array, pos: Array) -> list[Array]:
    """[q, keys, values] of a layer inside the whole step: as the RoPE kernel returns them (its
    writes done in place), or with k and v written into new buffers at the position."""
    if plan.rope is not None:
        return heads
    q, k, v = heads
    start = mx.reshape(rope_kv_kernel.scalar_position(pos), (1,))
    return [q, mx.slice_update_dynamic(keys, k, start, [2]), mx.slice_update_dynamic(values, v, start, [2])]


@dataclass
class WholeStep:
    """What a trace of the whole step reads: the plan and which attention kernel the graph holds."""

    plan: SegmentPlan
    single: bool  # the one-pass attention kernel (up to decode_attention.ONE_PASS_KEYS keys)


def _trace_whole(inputs: list[Array]) -> list[Array]:
    """The whole step as one graph: inputs [tokens, pos, keys 0, values 0, ..., the RoPE kernel's
    table (where the plan has the kernel), *the plan's arrays]; outputs [ids or logits, pos + 1,
    keys 0, values 0, ...] (with the RoPE kernel the buffers themselves, written in place)."""
    spec: WholeStep = traced_spec()
    plan = spec.plan
    plan.first.stats["traces"] += 1
    layers = len(plan.scales)
    tokens, pos = inputs[0], inputs[1]
    buffers = inputs[2:2 + 2 * layers]
    tables = 1 if plan.rope is not None else 0  # the RoPE kernel's table follows the buffers
    table = inputs[2 + 2 * layers] if tables else None
    arrays = inputs[2 + 2 * layers + tables:]
    groups = [plan.first, *plan.mids, plan.last]

    def mods(g: int) -> list[Any]:
        return clone_modules(groups[g].modules, groups[g].arrays, [arrays[j] for j in plan.whole_index[g]])

    def kv(i: int) -> list[Array]:
        return [buffers[2 * i], buffers[2 * i + 1], table] if table is not None else []

    *heads, h = _first_body(plan.first, mods(0), tokens, pos, kv(0))
    written: list[Array] = []
    masks: dict[int, Array] = {}
    out: Array | None = None
    for i in range(layers):
        q, keys, values = _write_kv(plan, heads, buffers[2 * i], buffers[2 * i + 1], pos)
        written += [keys, values]
        attn_out = _whole_attention(plan, i, q, keys, values, pos, spec.single, masks)
        if i + 1 < layers:
            *heads, h = _mid_body(plan.mids[i], mods(i + 1), attn_out, h, pos, kv(i + 1))
        else:
            out = _last_body(plan.last, mods(i + 1), attn_out, h)
    assert out is not None  # a plan has at least one block
    return [out, pos + 1, *written]


@dataclass
class SegmentGroup:
    """The modules one segment call runs, their arrays (the call's fixed inputs) and flags."""

    modules: list[Module | None]
    arrays: list[Array]
    fixed: FixedArrays
    stats: dict[str, int]
    tied: bool = False
    fuse_greedy: bool = False
    fused_norm: bool = False  # residual adds and the norms after them in one kernel (`kernels/add_rms_norm.py`)
    cuda_argmax: bool = False  # greedy's argmax as `kernels/argmax.py`'s kernels
    rope: rope_kv_kernel.Rope | None = None  # RoPE and the key/value writes as `kernels/rope_kv.py`'s kernel
    pair_silu: bool = False  # each gate/up product and SiLU product as the paired matvec kernel
    # "all": residual adds inside the o/down products, block norms inside the q/k/v and gate/up
    # products; "ends": inside the q/k/v and down products only (`use_matvec_fusion`); "": neither
    matvec_fusion: str = ""
    # Which of the segment's layers take those forms (`fused_layers`): the block it ends ("", END_O or
    # END_BOTH: its o and down products, and gate/up with "all") and the block whose heads it
    # computes (its q/k/v product).
    ends_in_products: str = ""
    heads_in_product: bool = False
    rope_in_product: bool = False  # RoPE and the key/value writes inside the normalized q/k/v product

    @property
    def kv_inputs(self) -> int:
        """Inputs after the segment's own for the RoPE kernel: keys, values and the RoPE table."""
        return 0 if self.rope is None else 3


def segment_group(modules: Sequence[Module | None], stats: dict[str, int], **flags: Any) -> SegmentGroup:
    """The group of `modules` (None: absent), its arrays each once."""
    present = [m for m in modules if m is not None]
    arrays: list[Array] = []
    seen: set[int] = set()
    for m in present:
        for a in arrays_of(m):
            if id(a) not in seen:
                seen.add(id(a))
                arrays.append(a)
    return SegmentGroup(list(modules), arrays, FixedArrays(arrays), stats, **flags)


def call_segment(fn: Any, group: SegmentGroup, inputs: list[Array]) -> list[Array]:
    """Call a compiled segment with `inputs` and the group's arrays; a trace (the first call) reads
    the group's modules through `trace.spec()`."""
    return call_traced(fn, group, inputs, group.fixed)


class SegmentFunctions:
    """The three compiled segments of one model structure (kept by the decoder per structure)."""

    def __init__(self) -> None:
        self.first = mx.compile(_trace_first)
        # The middle segment per pair of its group's flags (`ends_in_products`, `heads_in_product`):
        # layers alike in their arrays' shapes but not in their forms must not share a trace.
        self.mids = {(ends, heads): mx.compile(_trace_mid) for ends in ("", END_O, END_BOTH) for heads in (False, True)}
        self.last = mx.compile(_trace_last)
        # The whole step (a plan with `attention`): one graph per attention kernel, short and long.
        self.whole = {True: mx.compile(_trace_whole), False: mx.compile(_trace_whole)}

    def clear(self) -> None:
        for fn in (self.first, *self.mids.values(), self.last, *self.whole.values()):
            fn.clear()

    def mid(self, group: SegmentGroup) -> Any:
        """The compiled middle segment for `group`'s flags."""
        return self.mids[(group.ends_in_products, group.heads_in_product)]


# ---------------------------------------------------------------------- a generation

class SegmentPlan:
    """What every segmented generation of one model (in its current state) reuses: the segment
    groups with their arrays converted once. Made again when the model's arrays change
    (`signature`: the ids of every array of the model; the plan holds those arrays, so an id
    cannot be reused by another array while the plan lives)."""

    def __init__(self, model: Any, blocks: list[Any], fuse_greedy: bool, stats: dict[str, int],
                 fusions: Sequence[tuple[Fusion | None, Fusion | None]] | None, signature: tuple[int, ...],
                 fused_norm: bool = False, cuda_argmax: bool = False,
                 rope: rope_kv_kernel.Rope | None = None, attention: str | None = None,
                 pair_silu: bool = False, matvec_fusion: str = "", rope_in_product: bool = False,
                 layers: Layers | None = None) -> None:
        inner = model.model
        tied = model.lm_head is None
        fusions = fusions or [(None, None)] * len(blocks)
        qkv = [f[0].fused if f[0] is not None else None for f in fusions]
        gate_up = [f[1].fused if f[1] is not None else None for f in fusions]
        self.pair_silu = pair_silu
        self.matvec_fusion = matvec_fusion
        self.rope_in_product = rope_in_product
        self.signature = signature
        self.fuse_greedy = fuse_greedy
        self.rope = rope  # each layer's RoPE and key/value writes as `kernels/rope_kv.py`'s kernel
        self.rope_kv = rope is not None
        # Per block: its q/k/v product and its end in the products' forms (`fused_layers`)
        heads, ends = layers if matvec_fusion and layers is not None else ((False,) * len(blocks), ("",) * len(blocks))
        self.layers = (heads, ends)
        ends = ends_in(matvec_fusion, ends)
        self.first = segment_group([inner.embed_tokens, blocks[0].input_layernorm, blocks[0].self_attn, qkv[0]], stats,
                            rope=rope, matvec_fusion=matvec_fusion, rope_in_product=rope_in_product,
                            heads_in_product=heads[0])
        self.fused_norm = fused_norm
        self.mids = [segment_group([blocks[i], gate_up[i], blocks[i + 1].input_layernorm, blocks[i + 1].self_attn,
                             qkv[i + 1]], stats, fused_norm=fused_norm, rope=rope, pair_silu=pair_silu,
                                    matvec_fusion=matvec_fusion, rope_in_product=rope_in_product,
                                    ends_in_products=ends[i], heads_in_product=heads[i + 1])
                     for i in range(len(blocks) - 1)]
        self.last = segment_group([blocks[-1], gate_up[-1], inner.norm, inner.embed_tokens, model.lm_head], stats,
                           tied=tied, fuse_greedy=fuse_greedy, fused_norm=fused_norm,
                           cuda_argmax=cuda_argmax and fuse_greedy, pair_silu=pair_silu,
                           matvec_fusion=matvec_fusion, ends_in_products=ends[-1])
        self.cuda_argmax = self.last.cuda_argmax
        self.scales = [float(b.self_attn.scale) for b in blocks]
        # The whole step as one graph (`_trace_whole`): "kernel" (attention as
        # `kernels/decode_attention.py`'s kernels), "mlx" (MLX's masked attention), or None (segments).
        self.attention = attention
        self.whole_fixed: FixedArrays | None = None
        self.whole_index: list[list[int]] = []
        if attention is not None:
            union: list[Array] = []
            where: dict[int, int] = {}
            for group in (self.first, *self.mids, self.last):
                for a in group.arrays:
                    if id(a) not in where:
                        where[id(a)] = len(union)
                        union.append(a)
                self.whole_index.append([where[id(a)] for a in group.arrays])
            self.whole_fixed = FixedArrays(union)

    def arrays(self) -> list[list[Array]]:
        return [g.arrays for g in (self.first, *self.mids, self.last)]


class SegmentedSession:
    """One generation's decode on the segments; `decode(first_inputs, max_tokens, queue)` yields the
    sampled ids [B] like `generate.decode`, the caches get the buffers back when it ends."""

    def __init__(self, plan: SegmentPlan, rings: Rings, fns: SegmentFunctions, sampler: Any,
                 first_position: int, on_fail: Callable[[BaseException], None]) -> None:
        self._rings = rings  # grows the buffers as positions arrive
        self._layers = rings.layers  # rings.RingLayer: cache and ring size (= buffer length)
        self._fns = fns
        self._fuse_greedy = plan.fuse_greedy
        self._sampler = sampler
        self._plan = plan
        self._first, self._mids, self._last = plan.first, plan.mids, plan.last
        self._scales = plan.scales
        self._rope = plan.rope
        self._buffers: list[Array] = []
        self._first_position = first_position
        self._position = first_position  # of the next step built
        self._on_fail = on_fail

    def _step(self, tokens: Array, pos: Array) -> tuple[Array, Array]:
        """One token through every layer at position `pos` (`_first_positions`); returns (sampled ids
        or logits, pos + 1)."""
        grown = self._rings.grow_for(self._position, self._buffers)
        if grown is not None:  # longer buffers (with the RoPE kernel: its own, written in place)
            self._buffers = [rope_kv_kernel.private_copy(a) for a in grown] if self._rope is not None else grown
        if self._plan.attention is not None:
            return self._whole_step(tokens, pos)
        fns = self._fns
        *heads, h = call_segment(fns.first, self._first, [tokens, pos, *self._kv_inputs(0)])
        out = None
        for i, scale in enumerate(self._scales):
            attn = self._attend(i, heads, scale)
            if i + 1 < len(self._scales):
                *heads, h = call_segment(fns.mid(self._mids[i]), self._mids[i], [attn, h, pos, *self._kv_inputs(i + 1)])
            else:
                out, pos = call_segment(fns.last, self._last, [attn, h, pos])
        self._position += 1
        assert out is not None  # the last layer's segment always runs (a plan has at least one block)
        return out, pos

    def _whole_step(self, tokens: Array, pos: Array) -> tuple[Array, Array]:
        """`_step` as one call of the whole-step graph; the buffers it returns are the session's."""
        plan = self._plan
        single = attention_kernel.one_pass(self._position + 1)
        table = [self._rope.table] if self._rope is not None else []
        assert plan.whole_fixed is not None  # made with the plan's `attention`
        out, pos, *buffers = call_traced(self._fns.whole[single], WholeStep(plan, single),
                                         [tokens, pos, *self._buffers, *table], plan.whole_fixed)
        self._buffers = buffers
        self._position += 1
        return out, pos

    def _first_positions(self) -> Array:
        """The first step's position as the segments carry it (see POSITION_WIDTH)."""
        if self._rope is None:
            return mx.array(self._position, dtype=mx.int32)
        return mx.array([self._position] * POSITION_WIDTH, dtype=mx.int32)

    def _kv_inputs(self, i: int) -> list[Array]:
        """What a segment projecting layer i's heads takes for the RoPE kernel (`SegmentGroup.kv_inputs`)."""
        if self._rope is None:
            return []
        return [self._buffers[2 * i], self._buffers[2 * i + 1], self._rope.table]

    def _attend(self, i: int, heads: list[Array], scale: float) -> Array:
        """Layer i's key and value into its buffers at this step's position (unless the segment's
        RoPE kernel wrote them: then `heads` is [q, keys, values]), then its attention over the keys
        so far."""
        p, buffers = self._position, self._buffers
        b, kvh, _, dk = buffers[2 * i].shape
        dv = buffers[2 * i + 1].shape[3]
        if self._rope is not None:
            q, keys, values = heads
        else:
            q, k, v = heads
            keys, values = buffers[2 * i], buffers[2 * i + 1]
            keys = mx.slice_update(keys, k, [0, 0, p, 0], [b, kvh, p + 1, dk], [1, 1, 1, 1])
            values = mx.slice_update(values, v, [0, 0, p, 0], [b, kvh, p + 1, dv], [1, 1, 1, 1])
        buffers[2 * i], buffers[2 * i + 1] = keys, values
        return _sdpa(q, mx.slice(keys, [0, 0, 0, 0], [b, kvh, p + 1, dk], [1, 1, 1, 1]),
                     mx.slice(values, [0, 0, 0, 0], [b, kvh, p + 1, dv], [1, 1, 1, 1]), scale=scale)

    def decode(self, first_inputs: Array, max_tokens: int, queue: StepQueue) -> Iterator[Array]:
        self._buffers = take_buffers(self._layers)  # the session owns them until it gives them back
        if self._rope is not None:  # written in place by the kernel: no other array may share them
            self._buffers = [rope_kv_kernel.private_copy(a) for a in self._buffers]
        queue.hand_over([first_inputs, self._buffers, self._plan.arrays()])
        b = first_inputs.shape[0]
        position: list[Array] = []  # the step's position input, carried from step to step

        def first() -> Array:
            try:  # the first call of each segment traces it
                out, pos = self._step(mx.reshape(first_inputs, (b,)), self._first_positions())
            except Exception as exc:
                self._on_fail(exc)
                raise CompileUnavailable(str(exc)) from exc
            position.append(pos)
            return out if self._fuse_greedy else self._sampler(out)

        def following(tokens: Array) -> Array:
            out, position[0] = self._step(tokens, position[0])
            return out if self._fuse_greedy else self._sampler(out)

        try:
            yield from queue.pipeline(first, following, max_tokens, queue.lookahead)
        finally:
            queue.drain(raise_errors=False)  # the buffers go back to the caches: every step scheduled
            if self._buffers:
                offset = self._first_position + queue.steps_kept(self._position - self._first_position)
                give_back(self._layers, self._buffers, offset)
                self._buffers = []


__all__ = ["END_BOTH", "END_O", "Layers", "ends_in",
           "fused_layers", "plan", "rope_of", "use_decode_attention", "use_matvec_fusion", "use_pair_silu",
           "use_rope_in_product", "WholeStep",
           "fuse", "fusions_for", "FusedProjection", "Fusion", "SegmentFunctions", "SegmentGroup",
           "SegmentPlan", "SegmentedSession", "call_segment", "segment_group"]
