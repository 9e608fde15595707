"""MLX operations with MLX's Python names and defaults.

Most functions are the generated wrappers of `_gen.RAW` re-exported as they are (their C parameter
names are MLX's). The families that MLX's Python API folds into one function (`sum`/`sum_axis`/
`sum_axes`, `split`/`split_sections`, ...) are dispatched here on the `axis` argument.
"""
from __future__ import annotations

import builtins as _builtins
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from . import _generated as _g
from . import dtypes as _dt
from ._gen import RAW, arr
from .array import Array, asarray
from .array import copy_handle as _copy_handle

if TYPE_CHECKING:
    # The same re-exports as typed in _generated.pyi, whose __all__ lists exactly those of the loop below.
    from ._generated import *  # noqa: F403
else:
    # Every plain generated op, re-exported under its MLX name (those defined below replace theirs).
    _SKIP_PREFIXES = ("fast_", "fft_", "linalg_", "random_", "distributed_")
    # `load` is io.load (by file type), which pymlxc.core exports beside these.
    _SKIP_NAMES = ("load",)
    for _name, _fn in RAW.items():
        if not _name.startswith(_SKIP_PREFIXES) and _name not in _SKIP_NAMES:
            globals()[_name] = _fn
    del _name, _fn

Axis = int | Sequence[int] | None


def _axis_family(base: str, a: Any, axis: Axis, *args: Any, stream: Any = None, **kw: Any) -> Array:
    a = arr(a)
    out: Array  # every family dispatched here makes one array
    if axis is None:
        out = RAW[base](a, *args, stream=stream, **kw)
        return out
    if isinstance(axis, int):
        single = RAW.get(base + "_axis")
        if single is not None:
            out = single(a, axis, *args, stream=stream, **kw)
            return out
        axis = [axis]
    out = RAW[base + "_axes"](a, list(axis), *args, stream=stream, **kw)
    return out


class Reduction(Protocol):
    """`sum`, `mean`, ...: over `axis` (all axes when None)."""

    def __call__(self, a: Any, axis: Axis = None, keepdims: bool = False, *, stream: Any = None) -> Array: ...


def _reduction(base: str) -> Reduction:
    whole: Callable[..., Array] = RAW[base]
    single: Callable[..., Array] = RAW[base + "_axis"]
    several: Callable[..., Array] = RAW[base + "_axes"]

    def reduce(a: Any, axis: Axis = None, keepdims: bool = False, *, stream: Any = None) -> Array:
        if axis is None:
            return whole(a, keepdims, stream)
        if type(axis) is int:
            return single(a, axis, keepdims, stream)
        return several(a, axis, keepdims, stream)

    reduce.__name__ = base
    reduce.__doc__ = f"`{base}` over `axis` (all axes when None)."
    return reduce


sum = _reduction("sum")  # noqa: A001
mean = _reduction("mean")
max = _reduction("max")  # noqa: A001
min = _reduction("min")  # noqa: A001
prod = _reduction("prod")
all = _reduction("all")  # noqa: A001
any = _reduction("any")  # noqa: A001
logsumexp = _reduction("logsumexp")


def var(a: Any, axis: Axis = None, keepdims: bool = False, ddof: int = 0, *, stream: Any = None) -> Array:
    return _axis_family("var", a, axis, ddof, keepdims=keepdims, stream=stream)


def std(a: Any, axis: Axis = None, keepdims: bool = False, ddof: int = 0, *, stream: Any = None) -> Array:
    return _axis_family("std", a, axis, ddof, keepdims=keepdims, stream=stream)


def argmax(a: Any, axis: int | None = None, keepdims: bool = False, *, stream: Any = None) -> Array:
    return _axis_family("argmax", a, axis, keepdims=keepdims, stream=stream)


def argmin(a: Any, axis: int | None = None, keepdims: bool = False, *, stream: Any = None) -> Array:
    return _axis_family("argmin", a, axis, keepdims=keepdims, stream=stream)


def softmax(a: Any, axis: Axis = None, precise: bool = False, *, stream: Any = None) -> Array:
    return _axis_family("softmax", a, axis, precise, stream=stream)


def median(a: Any, axis: Axis = None, keepdims: bool = False, *, stream: Any = None) -> Array:
    a = arr(a)
    axes = list(range(a.ndim)) if axis is None else [axis] if isinstance(axis, int) else list(axis)
    return _g.median(a, axes, keepdims=keepdims, stream=stream)


def sort(a: Any, axis: int | None = -1, *, stream: Any = None) -> Array:
    a = arr(a)
    return _g.sort(a, stream=stream) if axis is None else _g.sort_axis(a, axis, stream=stream)


def argsort(a: Any, axis: int | None = -1, *, stream: Any = None) -> Array:
    a = arr(a)
    return _g.argsort(a, stream=stream) if axis is None else _g.argsort_axis(a, axis, stream=stream)


def partition(a: Any, kth: int, axis: int | None = -1, *, stream: Any = None) -> Array:
    a = arr(a)
    return _g.partition(a, kth, stream=stream) if axis is None else _g.partition_axis(a, kth, axis, stream=stream)


def argpartition(a: Any, kth: int, axis: int | None = -1, *, stream: Any = None) -> Array:
    a = arr(a)
    return (_g.argpartition(a, kth, stream=stream) if axis is None
            else _g.argpartition_axis(a, kth, axis, stream=stream))


def topk(a: Any, k: int, axis: int | None = -1, *, stream: Any = None) -> Array:
    a = arr(a)
    return _g.topk(a, k, stream=stream) if axis is None else _g.topk_axis(a, k, axis, stream=stream)


def cumsum(a: Any, axis: int | None = None, *, reverse: bool = False, inclusive: bool = True,
           stream: Any = None) -> Array:
    a = arr(a)
    if axis is None:
        a, axis = reshape(a, [-1], stream=stream), 0
    return _g.cumsum(a, axis, reverse, inclusive, stream=stream)


def cumprod(a: Any, axis: int | None = None, *, reverse: bool = False, inclusive: bool = True,
            stream: Any = None) -> Array:
    a = arr(a)
    if axis is None:
        a, axis = reshape(a, [-1], stream=stream), 0
    return _g.cumprod(a, axis, reverse, inclusive, stream=stream)


def cummax(a: Any, axis: int | None = None, *, reverse: bool = False, inclusive: bool = True,
           stream: Any = None) -> Array:
    a = arr(a)
    if axis is None:
        a, axis = reshape(a, [-1], stream=stream), 0
    return _g.cummax(a, axis, reverse, inclusive, stream=stream)


def logcumsumexp(a: Any, axis: int | None = None, *, reverse: bool = False, inclusive: bool = True,
                 stream: Any = None) -> Array:
    a = arr(a)
    if axis is None:
        a, axis = reshape(a, [-1], stream=stream), 0
    return _g.logcumsumexp(a, axis, reverse, inclusive, stream=stream)


# ---------------------------------------------------------------------- creation

def array(value: Any, dtype: Any = None) -> Array:
    """A new Array (also from an Array: a new handle on the same data, as `mlx.core.array`)."""
    out = asarray(value, dtype)
    return _copy_handle(out) if out is value else out


def _shape(shape: int | Sequence[int]) -> list[int]:
    return [shape] if isinstance(shape, int) else [int(s) for s in shape]


def zeros(shape: int | Sequence[int], dtype: Any = _dt.float32, *, stream: Any = None) -> Array:
    return _g.zeros(_shape(shape), dtype, stream=stream)


def ones(shape: int | Sequence[int], dtype: Any = _dt.float32, *, stream: Any = None) -> Array:
    return _g.ones(_shape(shape), dtype, stream=stream)


def full(shape: int | Sequence[int], vals: Any, dtype: Any = None, *, stream: Any = None) -> Array:
    vals = asarray(vals)
    return _g.full(_shape(shape), vals, dtype if dtype is not None else vals.dtype, stream=stream)


def arange(start: float, stop: float | None = None, step: float | None = None, dtype: Any = None, *,
           stream: Any = None) -> Array:
    if stop is None:
        start, stop = 0, start
    if step is None:
        step = 1
    if dtype is None:
        dtype = _dt.int32 if _builtins.all(isinstance(v, int) for v in (start, stop, step)) else _dt.float32
    return _g.arange(float(start), float(stop), float(step), dtype, stream=stream)



def linspace(start: float, stop: float, num: int = 50, dtype: Any = _dt.float32, *, stream: Any = None) -> Array:
    return _g.linspace(float(start), float(stop), num, dtype, stream=stream)


def eye(n: int, m: int | None = None, k: int = 0, dtype: Any = _dt.float32, *, stream: Any = None) -> Array:
    return _g.eye(n, n if m is None else m, k, dtype, stream=stream)


def identity(n: int, dtype: Any = _dt.float32, *, stream: Any = None) -> Array:
    return _g.identity(n, dtype, stream=stream)


def tri(n: int, m: int | None = None, k: int = 0, dtype: Any = _dt.float32, *, stream: Any = None) -> Array:
    return _g.tri(n, n if m is None else m, k, dtype, stream=stream)


def tril(x: Any, k: int = 0, *, stream: Any = None) -> Array:
    return _g.tril(x, k, stream=stream)


def triu(x: Any, k: int = 0, *, stream: Any = None) -> Array:
    return _g.triu(x, k, stream=stream)


# ---------------------------------------------------------------------- shapes

_reshape = _g.reshape


def reshape(a: Any, shape: int | Sequence[int], *, stream: Any = None) -> Array:
    return _reshape(a, (shape,) if type(shape) is int else shape, stream)


def transpose(a: Any, axes: Sequence[int] | None = None, *, stream: Any = None) -> Array:
    return _g.transpose(a, stream=stream) if axes is None else _g.transpose_axes(a, list(axes), stream=stream)


def squeeze(a: Any, axis: Axis = None, *, stream: Any = None) -> Array:
    return _axis_family("squeeze", a, axis, stream=stream)


def expand_dims(a: Any, axis: int | Sequence[int], *, stream: Any = None) -> Array:
    if isinstance(axis, int):
        return _g.expand_dims(a, axis, stream=stream)
    return _g.expand_dims_axes(a, list(axis), stream=stream)


def concatenate(arrays: Sequence[Any], axis: int | None = 0, *, stream: Any = None) -> Array:
    if axis is None:
        return _g.concatenate([reshape(a, [-1]) for a in arrays], stream=stream)
    return _g.concatenate_axis(list(arrays), axis, stream=stream)


concat = concatenate


def stack(arrays: Sequence[Any], axis: int = 0, *, stream: Any = None) -> Array:
    return _g.stack_axis(list(arrays), axis, stream=stream)


def split(a: Any, indices_or_sections: int | Sequence[int], axis: int = 0, *, stream: Any = None) -> list[Array]:
    if isinstance(indices_or_sections, int):
        return _g.split(a, indices_or_sections, axis, stream=stream)
    return _g.split_sections(a, list(indices_or_sections), axis, stream=stream)


def flatten(a: Any, start_axis: int = 0, end_axis: int = -1, *, stream: Any = None) -> Array:
    return _g.flatten(a, start_axis, end_axis, stream=stream)


def unflatten(a: Any, axis: int, shape: Sequence[int], *, stream: Any = None) -> Array:
    return _g.unflatten(a, axis, list(shape), stream=stream)


def broadcast_to(a: Any, shape: Sequence[int], *, stream: Any = None) -> Array:
    return _g.broadcast_to(a, list(shape), stream=stream)


def take(a: Any, indices: Any, axis: int | None = None, *, stream: Any = None) -> Array:
    if isinstance(indices, int):
        indices = asarray(indices, _dt.int32)
    if axis is None:
        return _g.take(a, indices, stream=stream)
    return _g.take_axis(a, indices, axis, stream=stream)


def take_along_axis(a: Any, indices: Any, axis: int | None = None, *, stream: Any = None) -> Array:
    if axis is None:
        return _g.take_along_axis(reshape(a, [-1]), reshape(indices, [-1]), 0, stream=stream)
    return _g.take_along_axis(a, indices, axis, stream=stream)


def put_along_axis(a: Any, indices: Any, values: Any, axis: int, *, stream: Any = None) -> Array:
    return _g.put_along_axis(a, indices, values, axis, stream=stream)


def repeat(a: Any, repeats: int, axis: int | None = None, *, stream: Any = None) -> Array:
    if axis is None:
        return _g.repeat(a, repeats, stream=stream)
    return _g.repeat_axis(a, repeats, axis, stream=stream)


def roll(a: Any, shift: int | Sequence[int], axis: Axis = None, *, stream: Any = None) -> Array:
    shifts = [shift] if isinstance(shift, int) else list(shift)
    if axis is None:
        return _g.roll(a, shifts, stream=stream)
    if isinstance(axis, int):
        return _g.roll_axis(a, shifts, axis, stream=stream)
    return _g.roll_axes(a, shifts, list(axis), stream=stream)


def pad(a: Any, pad_width: int | Sequence[Any], mode: str = "constant", constant_values: Any = 0, *,
        stream: Any = None) -> Array:
    a = arr(a)
    if isinstance(pad_width, int):
        widths = [(pad_width, pad_width)] * a.ndim
    else:
        widths = [tuple(w) if not isinstance(w, int) else (w, w) for w in pad_width]
        if len(widths) == 1:
            widths = widths * a.ndim
    return _g.pad(a, list(range(a.ndim)), [w[0] for w in widths], [w[1] for w in widths],
                      asarray(constant_values, a.dtype), mode, stream=stream)


def tile(a: Any, reps: int | Sequence[int], *, stream: Any = None) -> Array:
    return _g.tile(a, _shape(reps), stream=stream)


def clip(a: Any, a_min: Any = None, a_max: Any = None, *, stream: Any = None) -> Array:
    return _g.clip(a, a_min, a_max, stream=stream)


def where(condition: Any, x: Any, y: Any, *, stream: Any = None) -> Array:
    """x where condition, else y (a Python scalar takes the other operand's dtype, as in MLX)."""
    return _g.where(condition, x, y, stream=stream)


def diagonal(a: Any, offset: int = 0, axis1: int = 0, axis2: int = 1, *, stream: Any = None) -> Array:
    return _g.diagonal(a, offset, axis1, axis2, stream=stream)


def diag(a: Any, k: int = 0, *, stream: Any = None) -> Array:
    return _g.diag(a, k, stream=stream)


def trace(a: Any, offset: int = 0, axis1: int = 0, axis2: int = 1, dtype: Any = None, *, stream: Any = None) -> Array:
    a = arr(a)
    return _g.trace(a, offset, axis1, axis2, dtype or a.dtype, stream=stream)


def tensordot(a: Any, b: Any, axes: int | Sequence[Sequence[int]] = 2, *, stream: Any = None) -> Array:
    if isinstance(axes, int):
        return _g.tensordot_axis(a, b, axes, stream=stream)
    return _g.tensordot(a, b, list(axes[0]), list(axes[1]), stream=stream)


def einsum(subscripts: str, *operands: Any, stream: Any = None) -> Array:
    return _g.einsum(subscripts, list(operands), stream=stream)


def round(a: Any, decimals: int = 0, *, stream: Any = None) -> Array:  # noqa: A001
    return _g.round(a, decimals, stream=stream)


def isclose(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False, *,
            stream: Any = None) -> Array:
    return _g.isclose(a, b, rtol, atol, equal_nan, stream=stream)


def allclose(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False, *,
             stream: Any = None) -> Array:
    return _g.allclose(a, b, rtol, atol, equal_nan, stream=stream)


def array_equal(a: Any, b: Any, equal_nan: bool = False, *, stream: Any = None) -> Array:
    return _g.array_equal(a, b, equal_nan, stream=stream)


def nan_to_num(a: Any, nan: float = 0.0, posinf: float | None = None, neginf: float | None = None, *,
               stream: Any = None) -> Array:
    return _g.nan_to_num(a, nan, posinf, neginf, stream=stream)


def moveaxis(a: Any, source: int, destination: int, *, stream: Any = None) -> Array:
    return _g.moveaxis(a, source, destination, stream=stream)


def swapaxes(a: Any, axis1: int, axis2: int, *, stream: Any = None) -> Array:
    return _g.swapaxes(a, axis1, axis2, stream=stream)


def meshgrid(*arrays: Any, sparse: bool = False, indexing: str = "xy", stream: Any = None) -> list[Array]:
    return _g.meshgrid(list(arrays), sparse, indexing, stream=stream)


def broadcast_arrays(*arrays: Any, stream: Any = None) -> list[Array]:
    return _g.broadcast_arrays(list(arrays), stream=stream)


def conv1d(input: Any, weight: Any, stride: int = 1, padding: int = 0, dilation: int = 1,  # noqa: A002
           groups: int = 1, *, stream: Any = None) -> Array:
    return _g.conv1d(input, weight, stride, padding, dilation, groups, stream=stream)


def conv2d(input: Any, weight: Any, stride: int | tuple[int, int] = 1, padding: int | tuple[int, int] = 0,  # noqa: A002
           dilation: int | tuple[int, int] = 1, groups: int = 1, *, stream: Any = None) -> Array:
    s = (stride, stride) if isinstance(stride, int) else stride
    p = (padding, padding) if isinstance(padding, int) else padding
    d = (dilation, dilation) if isinstance(dilation, int) else dilation
    return _g.conv2d(input, weight, s[0], s[1], p[0], p[1], d[0], d[1], groups, stream=stream)


def addmm(c: Any, a: Any, b: Any, alpha: float = 1.0, beta: float = 1.0, *, stream: Any = None) -> Array:
    return _g.addmm(c, a, b, alpha, beta, stream=stream)


def softplus(a: Any, *, stream: Any = None) -> Array:
    return _g.logaddexp(a, _g.zeros_like(a), stream=stream)


# ---------------------------------------------------------------------- quantization

def quantize(w: Any, group_size: int = 64, bits: int = 4, mode: str = "affine", *,
             stream: Any = None) -> tuple[Array, ...]:
    """Quantize `w` along its last axis: (packed weights, scales, biases) for "affine"."""
    return tuple(_g.quantize(w, mode, group_size=group_size, bits=bits, stream=stream))


def dequantize(w: Any, scales: Any, biases: Any = None, group_size: int = 64, bits: int = 4, mode: str = "affine",
               dtype: Any = None, *, stream: Any = None) -> Array:
    return _g.dequantize(w, scales, mode, biases=biases, group_size=group_size, bits=bits, dtype=dtype, stream=stream)


def quantized_matmul(x: Any, w: Any, scales: Any, biases: Any = None, transpose: bool = True, group_size: int = 64,
                     bits: int = 4, mode: str = "affine", *, stream: Any = None) -> Array:
    return _g.quantized_matmul(x, w, scales, transpose, mode, biases=biases, group_size=group_size, bits=bits,
                               stream=stream)


def gather_qmm(x: Any, w: Any, scales: Any, biases: Any = None, lhs_indices: Any = None, rhs_indices: Any = None,
               transpose: bool = True, group_size: int = 64, bits: int = 4, mode: str = "affine",
               sorted_indices: bool = False, *, stream: Any = None) -> Array:
    return _g.gather_qmm(x, w, scales, transpose, mode, sorted_indices, biases=biases, lhs_indices=lhs_indices,
                             rhs_indices=rhs_indices, group_size=group_size, bits=bits, stream=stream)


def gather_mm(a: Any, b: Any, lhs_indices: Any = None, rhs_indices: Any = None, sorted_indices: bool = False,
              *, stream: Any = None) -> Array:
    return _g.gather_mm(a, b, sorted_indices, lhs_indices=lhs_indices, rhs_indices=rhs_indices, stream=stream)


def astype(a: Any, dtype: Any, *, stream: Any = None) -> Array:
    return _g.astype(a, _dt.as_dtype(dtype), stream=stream)


def contiguous(a: Any, allow_col_major: bool = False, *, stream: Any = None) -> Array:
    return _g.contiguous(a, allow_col_major, stream=stream)
