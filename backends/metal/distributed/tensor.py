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
TENSOR_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "qwen2_moe", "qwen3_moe")

_qmm = mx.quantized_matmul
_all_sum = dist.all_sum


def part(a: Array, axis: int, rank: int, size: int) -> Array:
    """This rank's contiguous 1/size of `a` along `axis`, as its own buffer (a slice alone would be a
    view that keeps the whole tensor alive)."""
    n = a.shape[axis]
    step = n // size
    index = [slice(None)] * a.ndim
    index[axis] = slice(rank * step, (rank + 1) * step)
    return mx.copy(a[tuple(index)])


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


_ROW_FORMS: dict[type, type] = {
    nn.Linear: AllSumLinear, nn.QuantizedLinear: AllSumQuantizedLinear,
    SwitchLinear: AllSumSwitchLinear, QuantizedSwitchLinear: AllSumQuantizedSwitchLinear,
}


# ---------------------------------------------------------------------- splitting one layer

def _is_quantized(layer: nn.Module) -> bool:
    return isinstance(layer, (nn.QuantizedLinear, QuantizedSwitchLinear))


def _out_axis(layer: nn.Module) -> int:
    return layer.weight.ndim - 2  # (out, in) or (experts, out, in)


def split_columns(layer: nn.Module, name: str, rank: int, size: int, unit: int = 1) -> None:
    """Keep this rank's output rows of `layer` (column parallel): weight, quantization data and
    bias. `unit`: rows that must stay together (a head's head_dim)."""
    axis = _out_axis(layer)
    rows = layer.weight.shape[axis]
    if rows % (size * unit):
        raise ShardingError(f"{name}: {rows} output rows cannot be split in {size} equal parts"
                            + (f" of whole {unit}-row heads" if unit > 1 else ""))
    updates = {"weight": part(layer.weight, axis, rank, size)}
    if _is_quantized(layer):
        updates["scales"] = part(layer.scales, axis, rank, size)
        updates["biases"] = part(layer.biases, axis, rank, size)
    if "bias" in vars(layer):
        updates["bias"] = part(layer.bias, layer.bias.ndim - 1, rank, size)
    for key, value in updates.items():
        setattr(layer, key, value)


def split_rows(parent: nn.Module, attr: str, name: str, group: dist.Group) -> None:
    """Replace `parent.<attr>` by its row-parallel form holding this rank's input columns (the
    bias stays whole, added after the sum)."""
    layer = getattr(parent, attr)
    rank, size = group.rank(), group.size()
    form = _ROW_FORMS.get(type(layer))
    if form is None:
        raise ShardingError(f"{name}: a {type(layer).__name__} cannot be split for tensor parallelism")
    if _is_quantized(layer):
        in_dims = layer.weight.shape[-1] * 32 // layer.bits
        if in_dims % (size * layer.group_size):
            raise ShardingError(f"{name}: {in_dims} inputs in groups of {layer.group_size} cannot be split in "
                                f"{size} equal parts at group boundaries")
        updates = {"weight": part(layer.weight, -1, rank, size), "scales": part(layer.scales, -1, rank, size),
                   "biases": part(layer.biases, -1, rank, size)}
    else:
        in_dims = layer.weight.shape[-1]
        if in_dims % size:
            raise ShardingError(f"{name}: {in_dims} inputs cannot be split in {size} equal parts")
        updates = {"weight": part(layer.weight, layer.weight.ndim - 1, rank, size)}
    new = form.__new__(form)
    new.__dict__.update(vars(layer))  # the same parameters, names and flags: only the call differs
    new._group = group
    for key, value in updates.items():
        setattr(new, key, value)  # through __setattr__: a Linear re-derives its W^T
    setattr(parent, attr, new)


# ---------------------------------------------------------------------- blocks

def _check_heads(model: Any, size: int) -> None:
    args = model.args
    n_heads, n_kv = int(args.num_attention_heads), int(args.num_key_value_heads)
    if n_heads % size or n_kv % size:
        raise ShardingError(f"tensor parallelism over {size} ranks needs the attention heads divisible by {size}: "
                            f"this {model.model_type} model has {n_heads} query heads and {n_kv} key/value heads "
                            "(use fewer ranks, or distributed='pipeline')")


def _shard_attention(attn: nn.Module, name: str, group: dist.Group) -> None:
    rank, size = group.rank(), group.size()
    hd = int(attn.head_dim)
    split_columns(attn.q_proj, f"{name}.q_proj", rank, size, hd)
    split_columns(attn.k_proj, f"{name}.k_proj", rank, size, hd)
    split_columns(attn.v_proj, f"{name}.v_proj", rank, size, hd)
    split_rows(attn, "o_proj", f"{name}.o_proj", group)
    attn.n_heads //= size
    attn.n_kv_heads //= size


def _shard_mlp(mlp: nn.Module, name: str, group: dist.Group) -> None:
    rank, size = group.rank(), group.size()
    split_columns(mlp.gate_proj, f"{name}.gate_proj", rank, size)
    split_columns(mlp.up_proj, f"{name}.up_proj", rank, size)
    split_rows(mlp, "down_proj", f"{name}.down_proj", group)


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


def shard_tensor_parallel(model: Any, group: dist.Group, *, evaluate: bool = True) -> None:
    """Split `model` in place over `group` for tensor parallelism: a loaded model (its parts are
    then evaluated, `evaluate`), or one built with placeholders whose weights are read afterwards
    in this rank's shapes (`partial.narrow_weights`; `evaluate=False`: nothing is computed)."""
    size = group.size()
    if model.model_type not in TENSOR_FAMILIES:
        raise ShardingError(f"tensor parallelism does not support model type {model.model_type!r}; supported: "
                            f"{', '.join(TENSOR_FAMILIES)} (distributed='pipeline' splits other models by layers)")
    if size == 1:
        return
    _check_heads(model, size)
    for i, layer in enumerate(model.layers):
        _shard_attention(layer.self_attn, f"model.layers.{i}.self_attn", group)
        _shard_ffn(layer.mlp, f"model.layers.{i}.mlp", group)
    if evaluate:
        mx.eval(model.parameters_and_constants()[0])


__all__ = ["TENSOR_FAMILIES", "shard_tensor_parallel", "split_columns", "split_rows", "part"]
