"""Mixture-of-experts layers: the experts of a layer stacked into one tensor, dispatched per token.

`SwitchLinear` holds E linear layers as one weight [E, out, in] (mlx-lm's "switch" layout, the
checkpoint names `switch_mlp.gate_proj.weight`, ...); `x` rows are multiplied by the expert that
`indices` picks for them through `gather_mm` (`gather_qmm` for `QuantizedSwitchLinear`), so no
per-expert Python loop and no per-expert weight copies. `SwitchGLU` is the gated MLP of the experts.

With many (token, expert) pairs the pairs are sorted by expert first, so that each expert's weight
is read once in a contiguous run (`sorted_indices=True`), and the results put back in token order.
"""
from __future__ import annotations

from collections.abc import Callable

import pymlxc.core as mx
from pymlxc.core import Array

from .. import nn

_SORT_AT = 64  # (token, expert) pairs from which sorting pays for itself (mlx-lm's threshold)


class SwitchLinear(nn.Module):
    """E stacked linear layers, weight [E, out, in] (bias [E, out]); `indices` picks one per row."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = mx.zeros((num_experts, output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: Array, indices: Array, sorted_indices: bool = False) -> Array:
        y = mx.gather_mm(x, mx.swapaxes(self.weight, -1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        b = self.__dict__.get("bias")
        return y if b is None else y + mx.expand_dims(mx.take(b, indices, axis=0), -2)


class QuantizedSwitchLinear(nn.Module):
    """A SwitchLinear with affine-quantized experts: packed uint32 `weight` [E, out, in*bits/32],
    `scales` and `biases` [E, out, in/group_size] (each expert quantized as a Linear would be)."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False, *,
                 group_size: int = 64, bits: int = 4, dtype: mx.Dtype = mx.float32) -> None:
        super().__init__()
        if input_dims % group_size:
            raise ValueError(f"input size {input_dims} is not a multiple of the group size {group_size}")
        self.group_size = group_size
        self.bits = bits
        self.weight = mx.zeros((num_experts, output_dims, input_dims * bits // 32), mx.uint32)
        self.scales = mx.zeros((num_experts, output_dims, input_dims // group_size), dtype)
        self.biases = mx.zeros((num_experts, output_dims, input_dims // group_size), dtype)
        if bias:
            self.bias = mx.zeros((num_experts, output_dims), dtype)
        self.freeze(["weight", "scales", "biases"], recurse=False)

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @classmethod
    def from_switch_linear(cls, layer: SwitchLinear, group_size: int = 64, bits: int = 4) -> QuantizedSwitchLinear:
        e, out_dims, in_dims = layer.weight.shape
        b = layer.__dict__.get("bias")
        q = cls(in_dims, out_dims, e, b is not None, group_size=group_size, bits=bits, dtype=layer.weight.dtype)
        q.weight, q.scales, q.biases = mx.quantize(layer.weight, group_size, bits)
        if b is not None:
            q.bias = b
        return q

    def __call__(self, x: Array, indices: Array, sorted_indices: bool = False) -> Array:
        y = mx.gather_qmm(x, self.weight, self.scales, self.biases, rhs_indices=indices, transpose=True,
                          group_size=self.group_size, bits=self.bits, sorted_indices=sorted_indices)
        b = self.__dict__.get("bias")
        return y if b is None else y + mx.expand_dims(mx.take(b, indices, axis=0), -2)


def _quantized_form(layer: nn.Module, *, group_size: int, bits: int) -> nn.Module:
    """The placeholder QuantizedSwitchLinear that `nn.quantize` swaps in (the loader fills it)."""
    assert isinstance(layer, SwitchLinear)
    e, out_dims, in_dims = layer.weight.shape
    return QuantizedSwitchLinear(in_dims, out_dims, e, "bias" in vars(layer), group_size=group_size, bits=bits,
                                 dtype=layer.weight.dtype)


nn.QUANTIZED_FORMS[SwitchLinear] = _quantized_form

AnySwitchLinear = SwitchLinear | QuantizedSwitchLinear
Activation = Callable[[Array, Array], Array]  # (gate, up) -> hidden


def swiglu(gate: Array, up: Array) -> Array:
    return nn.silu(gate) * up


def geglu(gate: Array, up: Array) -> Array:
    return nn.gelu_approx(gate) * up


def _sort_by_expert(x: Array, indices: Array) -> tuple[Array, Array, Array]:
    """x [..., 1, 1, D] and indices [..., k] -> one row per (token, expert) pair, ordered by expert:
    rows [N*k, 1, D], their experts [N*k], and the permutation that restores token order."""
    k = indices.shape[-1]
    flat = mx.flatten(indices)
    order = mx.argsort(flat)
    inverse = mx.argsort(order)
    rows = mx.take(mx.flatten(x, 0, -3), order // k, axis=0)
    return rows, mx.take(flat, order, axis=0), inverse


class SwitchGLU(nn.Module):
    """The experts' gated MLP: down(act(gate(x)) * up(x)) with each token's k experts.
    x [..., D], indices [..., k] -> [..., k, D] (one output per chosen expert, unweighted)."""

    def __init__(self, input_dims: int, hidden_dims: int, num_experts: int, activation: Activation = swiglu,
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_proj: AnySwitchLinear = SwitchLinear(input_dims, hidden_dims, num_experts, bias)
        self.up_proj: AnySwitchLinear = SwitchLinear(input_dims, hidden_dims, num_experts, bias)
        self.down_proj: AnySwitchLinear = SwitchLinear(hidden_dims, input_dims, num_experts, bias)
        self._activation = activation

    def __call__(self, x: Array, indices: Array) -> Array:
        x = mx.expand_dims(x, (-2, -3))  # [..., 1, 1, D]: one row for gather_mm, broadcast over k
        indices = mx.stop_gradient(indices)
        do_sort = indices.size >= _SORT_AT
        idx, inverse = indices, None
        if do_sort:
            x, idx, inverse = _sort_by_expert(x, indices)
        up = self.up_proj(x, idx, sorted_indices=do_sort)
        gate = self.gate_proj(x, idx, sorted_indices=do_sort)
        y = self.down_proj(self._activation(gate, up), idx, sorted_indices=do_sort)
        if inverse is not None:
            y = mx.unflatten(mx.take(y, inverse, axis=0), 0, indices.shape)
        return mx.squeeze(y, -2)


__all__ = ["SwitchLinear", "QuantizedSwitchLinear", "SwitchGLU", "swiglu", "geglu"]
