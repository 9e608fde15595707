"""Tensor parallelism applied to a built model: each rank keeps its share of every block's heads and
MLP columns, and one `all_sum` after each row-parallel projection makes every rank's hidden state
whole again (Megatron's layout; mlx-lm's `shard_linear`/`shard_inplace` do the same).

Per block: q/k/v projections keep this rank's heads (their output rows: column parallel), o_proj
the matching input columns (row parallel, then the all_sum); gate/up keep a slice of the
intermediate size, down_proj the matching columns (then the all_sum). Experts of a MoE block are
split the same way along their intermediate size, so every rank runs every expert on a slice; the
router and a shared expert's gate stay whole. Embeddings, norms and the output head stay whole on
every rank (a tied head needs nothing more). Quantized layers split at their group boundaries: a
row-parallel split needs each rank's input columns to be whole groups.

Gemma 4: the same per block (layers that reuse an earlier layer's keys and values have no k/v
projections; the source layer's heads of this rank are the ones they need), its experts split
like any. Qwen3-Next and Qwen 3.5 linear attention (Gated DeltaNet): each rank keeps a contiguous
share of the key heads and the value heads they serve (every key head serves consecutive value
heads), so its projections, its convolution channels, decay and write gates and recurrent state
are those heads'; out_proj is row parallel. Where one tensor holds several head groups one after
the other (Qwen 3.5's in_proj_qkv and both families' conv channels: all q, then all k, then all
v), each section is split and the rank's parts are joined: `layouts` names those tensors.
"""
from __future__ import annotations

from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core import distributed as dist

from .. import nn
from ..kernel_choice import quantized_matmul
from ..models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear
from .errors import ShardingError

# Families whose blocks are `self_attn` (q/k/v/o_proj, n_heads, n_kv_heads) + `mlp` (gate/up/down or
# a switch_mlp MoE): the ones this module knows how to split.
TENSOR_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "qwen2_moe", "qwen3_moe",
                   "gemma4", "gemma4_text", "qwen3_next", "qwen3_5", "qwen3_5_moe")

Layouts = dict[str, tuple[int, ...]]  # parameter name -> the sections of its split axis (absent: one)

_qmm = mx.quantized_matmul
_all_sum = dist.all_sum


def section_parts(n: int, rank: int, size: int, sections: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """The [start, stop) ranges along an axis of length `n` that rank `rank` of `size` keeps: its
    1/size of each section (one section, the whole axis, by default)."""
    sections = sections or (n,)
    if sum(sections) != n:
        raise ShardingError(f"sections {sections} do not add up to the axis length {n}")
    out, start = [], 0
    for length in sections:
        step = length // size
        out.append((start + rank * step, start + (rank + 1) * step))
        start += length
    return out


def part(a: Array, axis: int, rank: int, size: int, sections: tuple[int, ...] | None = None) -> Array:
    """This rank's 1/size of `a` along `axis` (of each of `sections`, joined), as its own buffer (a
    slice alone would be a view that keeps the whole tensor alive)."""
    axis = axis % a.ndim
    pieces = []
    for start, stop in section_parts(a.shape[axis], rank, size, sections):
        index = [slice(None)] * a.ndim
        index[axis] = slice(start, stop)
        pieces.append(a[tuple(index)])
    return mx.copy(pieces[0]) if len(pieces) == 1 else mx.concatenate(pieces, axis=axis)


# ---------------------------------------------------------------------- row-parallel layers

class AllSumLinear(nn.Linear):
    """A Linear holding this rank's input columns: the partial product, summed over the group,
    then the bias (added once)."""

    _group: dist.Group

    def __call__(self, x: Array) -> Array:
        y = _all_sum(mx.matmul(x, self._wT), group=self._group)
        b = self.__dict__.get("bias")
        return y if b is None else y + b


class AllSumQuantizedLinear(nn.QuantizedLinear):
    """The quantized form of AllSumLinear."""

    _group: dist.Group

    def __call__(self, x: Array) -> Array:
        if self._cuda_matvec:
            y = quantized_matmul(x, self.weight, self.scales, self.biases, self.group_size, self.bits, True)
        else:
            y = _qmm(x, self.weight, self.scales, self.biases, True, self.group_size, self.bits)
        y = _all_sum(y, group=self._group)
        b = self.__dict__.get("bias")
        return y if b is None else y + b


class AllSumSwitchLinear(SwitchLinear):
    """Experts' down projection over this rank's intermediate columns, summed over the group."""

    _group: dist.Group

    def __call__(self, x: Array, indices: Array, sorted_indices: bool = False) -> Array:
        y = mx.gather_mm(x, mx.swapaxes(self.weight, -1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        y = _all_sum(y, group=self._group)
        b = self.__dict__.get("bias")
        return y if b is None else y + mx.expand_dims(mx.take(b, indices, axis=0), -2)


class AllSumQuantizedSwitchLinear(QuantizedSwitchLinear):
    """The quantized form of AllSumSwitchLinear."""

    _group: dist.Group

    def __call__(self, x: Array, indices: Array, sorted_indices: bool = False) -> Array:
        y = mx.gather_qmm(x, self.weight, self.scales, self.biases, rhs_indices=indices, transpose=True,
                          group_size=self.group_size, bits=self.bits, sorted_indices=sorted_indices)
        y = _all_sum(y, group=self._group)
        b = self.__dict__.get("bias")
        return y if b is None else y + mx.expand_dims(mx.take(b, indices, axis=0), -2)


_ROW_FORMS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: AllSumLinear, nn.QuantizedLinear: AllSumQuantizedLinear,
    SwitchLinear: AllSumSwitchLinear, QuantizedSwitchLinear: AllSumQuantizedSwitchLinear,
}


# ---------------------------------------------------------------------- splitting one layer

def _is_quantized(layer: nn.Module) -> bool:
    return isinstance(layer, (nn.QuantizedLinear, QuantizedSwitchLinear))


def _is_block(layer: nn.Module) -> bool:
    """A GGUF block layer (weights as rows of llama.cpp blocks: one more trailing axis)."""
    if not type(layer).__module__.endswith("gguf_layers") and not hasattr(layer, "qtype"):
        return False
    from .blocks import is_block  # noqa: PLC0415 - needs the optional gguf package: GGUF models only

    return is_block(layer)


def _out_axis(layer: nn.Module) -> int:
    # (out, in) or (experts, out, in); block layers (out, blocks, bytes) or (experts, out, blocks, bytes)
    weight: Array = vars(layer)["weight"]  # every splittable layer holds its weight as a parameter
    return weight.ndim - (3 if _is_block(layer) else 2)


def _row_form(layer: nn.Module) -> type[nn.Module] | None:
    form = _ROW_FORMS.get(type(layer))
    if form is None and _is_block(layer):
        from .blocks import ROW_FORMS  # noqa: PLC0415 - see _is_block

        form = ROW_FORMS.get(type(layer))
    return form


def split_columns(layer: Any, name: str, rank: int, size: int, unit: int = 1,
                  sections: tuple[int, ...] | None = None, layouts: Layouts | None = None) -> None:
    """Keep this rank's output rows of `layer` (column parallel): weight, quantization data and
    bias. `unit`: rows that must stay together (a head's head_dim); `sections`: row groups split
    each on its own (recorded in `layouts` under the parameters' names)."""
    axis = _out_axis(layer)
    rows = layer.weight.shape[axis]
    for length in sections or (rows,):
        if length % (size * unit):
            raise ShardingError(f"{name}: {length} output rows cannot be split in {size} equal parts"
                                + (f" of whole {unit}-row heads" if unit > 1 else ""))
    updates = {"weight": part(layer.weight, axis, rank, size, sections)}
    if _is_quantized(layer):
        updates["scales"] = part(layer.scales, axis, rank, size, sections)
        updates["biases"] = part(layer.biases, axis, rank, size, sections)
    if "bias" in vars(layer):
        updates["bias"] = part(layer.bias, layer.bias.ndim - 1, rank, size, sections)
    if _is_block(layer) and "output_dims" in vars(layer):
        layer.output_dims //= size
    for key, value in updates.items():
        setattr(layer, key, value)
        if sections is not None and layouts is not None:
            layouts[f"{name}.{key}"] = sections


def split_rows(parent: nn.Module, attr: str, name: str, group: dist.Group) -> None:
    """Replace `parent.<attr>` by its row-parallel form holding this rank's input columns (the
    bias stays whole, added after the sum)."""
    layer = getattr(parent, attr)
    rank, size = group.rank(), group.size()
    form = _row_form(layer)
    if form is None:
        raise ShardingError(f"{name}: a {type(layer).__name__} cannot be split for tensor parallelism")
    if _is_quantized(layer):
        in_dims = layer.weight.shape[-1] * 32 // layer.bits
        if in_dims % (size * layer.group_size):
            raise ShardingError(f"{name}: {in_dims} inputs in groups of {layer.group_size} cannot be split in "
                                f"{size} equal parts at group boundaries")
        updates = {"weight": part(layer.weight, -1, rank, size), "scales": part(layer.scales, -1, rank, size),
                   "biases": part(layer.biases, -1, rank, size)}
    elif _is_block(layer):
        blocks = layer.weight.shape[-2]
        if blocks % size:
            raise ShardingError(f"{name}: {blocks} blocks of {layer.qtype.name} a row cannot be split in {size} "
                                "equal parts of whole blocks")
        updates = {"weight": part(layer.weight, -2, rank, size)}
        if "input_dims" in vars(layer):
            updates["input_dims"] = layer.input_dims // size
    else:
        in_dims = layer.weight.shape[-1]
        if in_dims % size:
            raise ShardingError(f"{name}: {in_dims} inputs cannot be split in {size} equal parts")
        updates = {"weight": part(layer.weight, layer.weight.ndim - 1, rank, size)}
    new = form.__new__(form)
    # The same parameters, names and flags, and the group the call sums over: only the call differs.
    new.__dict__.update(vars(layer), _group=group)
    for key, value in updates.items():
        setattr(new, key, value)  # through __setattr__: a Linear re-derives its W^T
    setattr(parent, attr, new)


# ---------------------------------------------------------------------- blocks

def _check_heads(model: Any, size: int) -> None:
    args = model.args
    n_heads, n_kv = int(args.num_attention_heads), int(args.num_key_value_heads)
    n_global = getattr(args, "num_global_key_value_heads", None)  # Gemma 4's full-attention layers
    if n_heads % size or n_kv % size or (n_global and n_global % size):
        raise ShardingError(f"tensor parallelism over {size} ranks needs the attention heads divisible by {size}: "
                            f"this {model.model_type} model has {n_heads} query heads and {n_kv} key/value heads"
                            + (f" ({n_global} in its global layers)" if n_global else "")
                            + " (use fewer ranks, or distributed='pipeline')")
    n_linear = getattr(args, "linear_num_key_heads", None)  # Gated DeltaNet layers
    if n_linear is not None and n_linear % size:
        raise ShardingError(f"tensor parallelism over {size} ranks needs the linear-attention key heads divisible "
                            f"by {size}: this {model.model_type} model has {n_linear} "
                            f"({args.linear_num_value_heads} value heads)")


def _shard_attention(attn: Any, name: str, group: dist.Group) -> None:
    rank, size = group.rank(), group.size()
    hd = int(attn.head_dim)
    split_columns(attn.q_proj, f"{name}.q_proj", rank, size, hd)
    for proj in ("k_proj", "v_proj"):  # absent where a layer reuses another's keys/values (Gemma 4)
        if isinstance(getattr(attn, proj, None), nn.Module):
            split_columns(getattr(attn, proj), f"{name}.{proj}", rank, size, hd)
    split_rows(attn, "o_proj", f"{name}.o_proj", group)
    attn.n_heads //= size
    attn.n_kv_heads //= size


def _shard_linear_attention(la: Any, name: str, group: dist.Group, layouts: Layouts) -> None:
    """A Gated DeltaNet layer: this rank's key heads and the value heads they serve."""
    rank, size = group.rank(), group.size()
    kd, vd = int(la.key_dim), int(la.value_dim)
    qkv = (kd, kd, vd)  # the conv channels and Qwen 3.5's in_proj_qkv rows: all q, all k, all v
    if isinstance(getattr(la, "in_proj_qkvz", None), nn.Module):  # Qwen3-Next: grouped per key head
        split_columns(la.in_proj_qkvz, f"{name}.in_proj_qkvz", rank, size)
        split_columns(la.in_proj_ba, f"{name}.in_proj_ba", rank, size)
    else:  # Qwen 3.5
        split_columns(la.in_proj_qkv, f"{name}.in_proj_qkv", rank, size, sections=qkv, layouts=layouts)
        for proj in ("in_proj_z", "in_proj_b", "in_proj_a"):
            split_columns(getattr(la, proj), f"{name}.{proj}", rank, size)
    la.conv1d.weight = part(la.conv1d.weight, 0, rank, size, qkv)
    layouts[f"{name}.conv1d.weight"] = qkv
    la.dt_bias = part(la.dt_bias, 0, rank, size)
    la.A_log = part(la.A_log, 0, rank, size)
    split_rows(la, "out_proj", f"{name}.out_proj", group)
    la.num_k_heads //= size
    la.num_v_heads //= size
    la.key_dim, la.value_dim = kd // size, vd // size
    la.conv_dim = la.key_dim * 2 + la.value_dim


def _shard_mlp(mlp: Any, name: str, group: dist.Group) -> None:
    rank, size = group.rank(), group.size()
    split_columns(mlp.gate_proj, f"{name}.gate_proj", rank, size)
    split_columns(mlp.up_proj, f"{name}.up_proj", rank, size)
    split_rows(mlp, "down_proj", f"{name}.down_proj", group)


def _shard_layer(layer: Any, name: str, group: dist.Group, layouts: Layouts) -> None:
    """One block: its attention (or linear attention) and its feed-forward part(s)."""
    if isinstance(getattr(layer, "linear_attn", None), nn.Module):
        _shard_linear_attention(layer.linear_attn, f"{name}.linear_attn", group, layouts)
    else:
        _shard_attention(layer.self_attn, f"{name}.self_attn", group)
    _shard_ffn(layer.mlp, f"{name}.mlp", group)
    experts = getattr(layer, "experts", None)  # Gemma 4's MoE beside its dense MLP; the router stays whole
    if isinstance(experts, nn.Module):
        _shard_mlp(layer.experts.switch_glu, f"{name}.experts.switch_glu", group)


def _shard_ffn(mlp: nn.Module, name: str, group: dist.Group) -> None:
    switch = getattr(mlp, "switch_mlp", None)
    if isinstance(switch, SwitchGLU):  # a MoE block: every expert split along its intermediate size
        _shard_mlp(switch, f"{name}.switch_mlp", group)
        shared = getattr(mlp, "shared_expert", None)
        if shared is not None:
            _shard_mlp(shared, f"{name}.shared_expert", group)
        return
    if all(isinstance(getattr(mlp, p, None), nn.Module) for p in ("gate_proj", "up_proj", "down_proj")):
        _shard_mlp(mlp, name, group)
        return
    raise ShardingError(f"{name}: a {type(mlp).__name__} cannot be split for tensor parallelism")


def shard_tensor_parallel(model: Any, group: dist.Group, *, evaluate: bool = True) -> Layouts:
    """Split `model` in place over `group` for tensor parallelism: a loaded model (its parts are
    then evaluated, `evaluate`), or one built with placeholders whose weights are read afterwards
    in this rank's shapes (`partial.narrow_weights`; `evaluate=False`: nothing is computed).
    Returns the parameters split by sections (see the module doc)."""
    size = group.size()
    if model.model_type not in TENSOR_FAMILIES:
        raise ShardingError(f"tensor parallelism does not support model type {model.model_type!r}; supported: "
                            f"{', '.join(TENSOR_FAMILIES)} (distributed='pipeline' splits other models by layers)")
    layouts: Layouts = {}
    if size == 1:
        return layouts
    _check_heads(model, size)
    for i, layer in enumerate(model.layers):
        _shard_layer(layer, f"model.layers.{i}", group, layouts)
    if evaluate:
        mx.eval(model.parameters_and_constants()[0])
    return layouts


__all__ = ["TENSOR_FAMILIES", "Layouts", "part", "section_parts", "shard_tensor_parallel", "split_columns",
           "split_rows"]
