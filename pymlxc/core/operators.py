"""Python operators, indexing and slice assignment for `Array` (attached at import)."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _generated as _g
from . import device as _device
from . import dtypes as _dt
from . import ops
from ._gen import GENERATED_ENV, fail, result_lines
from ._loader import fast, ffi, gc_cdata, new_cdata
from .array import (
    INEXACT_DTYPES,
    RESULT_SLOT,
    Array,
    asarray,
    copy_handle,
    freed,
    scalar,
    scalar_handle,
    weak_dtype,
    weak_handle,
)
from .device import current_stream

# ---------------------------------------------------------------------- arithmetic operators

_float32, _int32 = _dt.float32, _dt.int32
_new_float32, _new_int, _free = fast.mlx_array_new_float32, fast.mlx_array_new_int, fast.mlx_array_free


def other_handle(self: Array, other: Any) -> Any:
    """The handle of the right-hand operand (weakly typed against `self`), or NotImplemented.
    The common `x * 0.5` on float32 and `i + 1` on int32 are done here without further calls."""
    t = type(other)
    if t is float or t is int:
        try:
            dtype = self._dtype
        except AttributeError:
            dtype = self.dtype
        if t is float:
            if dtype is _float32 or dtype not in INEXACT_DTYPES:
                return gc_cdata(_new_float32(other), _free)
        elif dtype is _int32 and -2147483648 <= other <= 2147483647:
            return gc_cdata(_new_int(other), _free)
        return scalar_handle(other, weak_dtype(dtype, t))
    return weak_handle(other, self.dtype)


def _binary_method(cname: str, reverse: bool) -> Callable[[Array, Any], Array]:
    """`Array.__<op>__` for mlx-c's binary `cname`, generated like the wrappers in `_gen` (one
    function, no intermediate calls: this is the path of `a + b`)."""
    x, y = ("_h_b", "_h_a") if reverse else ("_h_a", "_h_b")
    lines = [
        "def method(self, other):",
        "    _h_a = self._h",
        "    if type(other) is Array:",
        "        _h_b = other._h",
        "    else:",
        "        _h_b = _other_handle(self, other)",
        "        if _h_b is NotImplemented:",
        "            return NotImplemented",
        "    if _h_a is None or _h_b is None:",
        "        _freed()",
        "    try:",
        "        _s = _tls.c",
        "    except AttributeError:",
        "        _s = _current()",
    ]
    lines += [
        "    _r0 = _new(_AP)",
        f"    if _c_{cname}(_r0, {x}, {y}, _s):",
        "        fail(_r0)",
    ]
    lines += ["    " + line for line in result_lines("_r0", "_o0")]
    lines.append("    return _o0")
    GENERATED_ENV["_c_" + cname] = getattr(fast, cname)
    GENERATED_ENV["_other_handle"] = other_handle
    exec(compile("\n".join(lines), f"<pymlxc operator {cname}{' reversed' if reverse else ''}>", "exec"), GENERATED_ENV)
    method: Callable[[Array, Any], Array] = GENERATED_ENV.pop("method")
    return method


for _dunder, _cname in [
    ("add", "mlx_add"), ("sub", "mlx_subtract"), ("mul", "mlx_multiply"), ("truediv", "mlx_divide"),
    ("floordiv", "mlx_floor_divide"), ("mod", "mlx_remainder"), ("pow", "mlx_power"), ("matmul", "mlx_matmul"),
    ("xor", "mlx_bitwise_xor"), ("lshift", "mlx_left_shift"), ("rshift", "mlx_right_shift"),
]:
    setattr(Array, f"__{_dunder}__", _binary_method(_cname, False))
    setattr(Array, f"__r{_dunder}__", _binary_method(_cname, True))

for _dunder, _cname in [("eq", "mlx_equal"), ("ne", "mlx_not_equal"), ("lt", "mlx_less"), ("le", "mlx_less_equal"),
                        ("gt", "mlx_greater"), ("ge", "mlx_greater_equal")]:
    setattr(Array, f"__{_dunder}__", _binary_method(_cname, False))


def _operand(self: Array, other: Any) -> Array:
    if isinstance(other, Array):
        return other
    t = type(other)
    if t is float or t is int or t is bool or t is complex:
        return scalar(other, weak_dtype(self.dtype, t))
    return asarray(other)


def _and(self: Array, other: Any) -> Array:
    b = _operand(self, other)
    if self.dtype is _dt.bool_ and b.dtype is _dt.bool_:
        return _g.logical_and(self, b)
    return _g.bitwise_and(self, b)


def _or(self: Array, other: Any) -> Array:
    b = _operand(self, other)
    if self.dtype is _dt.bool_ and b.dtype is _dt.bool_:
        return _g.logical_or(self, b)
    return _g.bitwise_or(self, b)


def _invert(self: Array) -> Array:
    return _g.logical_not(self) if self.dtype is _dt.bool_ else _g.bitwise_invert(self)


# Attached by name (Array declares their types for type checkers, see its class body).
_UNARY_AND_LOGICAL: dict[str, Callable[..., Any]] = {
    "__and__": _and, "__rand__": _and, "__or__": _or, "__ror__": _or,
    "__neg__": lambda self: _g.negative(self), "__pos__": lambda self: copy_handle(self),
    "__abs__": lambda self: _g.abs(self), "__invert__": _invert, "__hash__": lambda self: id(self),
}
for _dunder_name, _method in _UNARY_AND_LOGICAL.items():
    setattr(Array, _dunder_name, _method)


# ---------------------------------------------------------------------- methods mirroring mlx.core.array

# The functions themselves are the methods (each takes the array first): no wrapper layer.
for _name in ["sum", "mean", "max", "min", "prod", "all", "any", "var", "std", "argmax", "argmin", "logsumexp",
              "transpose", "squeeze", "flatten", "swapaxes", "moveaxis", "cumsum", "cumprod", "round",
              "diagonal", "split", "astype", "abs", "exp", "log", "sqrt", "square", "sin", "cos", "reciprocal",
              "rsqrt", "conjugate", "sort", "argsort", "softmax"]:
    setattr(Array, _name, getattr(ops, _name))

_raw_reshape = _g.reshape


def _reshape_method(self: Array, *shape: Any, stream: Any = None) -> Array:
    if len(shape) == 1 and type(shape[0]) is not int:
        shape = shape[0]
    return _raw_reshape(self, shape, stream)


for _name, _attribute in [("reshape", _reshape_method), ("T", property(lambda self: _g.transpose(self)))]:
    setattr(Array, _name, _attribute)


# ---------------------------------------------------------------------- indexing

_slice = _g.slice
_reshape = _g.reshape

#
# An index is first normalised to one entry per axis (Ellipsis expanded) plus None entries. Ints and
# slices make one `slice` call and one `reshape` (which drops int axes and adds None axes). Integer
# arrays follow numpy's rules: ints next to them count as 0-d index arrays, all of them broadcast
# together, and the broadcast index dimensions replace the indexed axes in place when those are next
# to each other in the index, or come first otherwise.

def _normalize(index: Any, ndim: int) -> list[Any]:
    """Expand Ellipsis; return a list of int / slice / None / Array entries covering every axis."""
    if not isinstance(index, tuple):
        index = (index,)
    items: list[Any] = []
    for i in index:
        if i is None or i is Ellipsis or type(i) is int or type(i) is slice:
            items.append(i)
        elif isinstance(i, Array):
            items.append(i if i.ndim else _int_of(i))
        elif isinstance(i, (list, np.ndarray)):
            a = asarray(i)
            items.append(a if a.ndim else _int_of(a))
        elif hasattr(i, "__index__"):
            items.append(int(i.__index__()))
        else:
            raise IndexError(f"unsupported index {i!r}: use ints, slices, None, Ellipsis or integer arrays")
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    ellipses = sum(1 for i in items if i is Ellipsis)
    if ellipses > 1:
        raise IndexError("an index can only have a single ellipsis")
    if consumed > ndim:
        raise IndexError(f"too many indices for array: array is {ndim}-dimensional, but {consumed} were indexed")
    out: list[Any] = []
    for i in items:
        if i is Ellipsis:
            out.extend([slice(None)] * (ndim - consumed))
            consumed = ndim
        else:
            out.append(i)
    out.extend([slice(None)] * (ndim - consumed))
    return out


def _int_of(a: Array) -> int:
    """A 0-d array index is an int index (it must be an integer)."""
    if not a.dtype.is_integer:
        raise IndexError(f"arrays used as indices must be integers, not {a.dtype.name}")
    return int(a.item())


def _check_index_array(idx: Array) -> None:
    if idx.dtype is _dt.bool_:
        raise IndexError("boolean mask indexing has a data-dependent shape, which MLX does not support")
    if not idx.dtype.is_integer:
        raise IndexError(f"arrays used as indices must be integers, not {idx.dtype.name}")


def _slice_bounds(e: slice, n: int) -> tuple[int, int, int, int]:
    """(start, stop, step, length) of a Python slice on an axis of size n, in MLX's slice convention."""
    start, stop, step = e.indices(n)
    if step == 1:
        return (start, stop, 1, stop - start) if stop > start else (0, 0, 1, 0)
    length = len(range(start, stop, step))
    if length == 0:  # Python's start/stop of an empty slice can mean other things to MLX
        return 0, 0, 1, 0
    if step < 0 and stop == -1:
        stop = -n - 1  # MLX reads a negative stop relative to the end
    return start, stop, step, length


def _int_bound(i: int, n: int, axis: int) -> int:
    if not -n <= i < n:
        raise IndexError(f"index {i} is out of bounds for axis {axis} with size {n}")
    return i % n


def _basic(a: Array, entries: list[Any]) -> tuple[Array, list[int]]:
    """Apply the slices and ints of `entries` (arrays keep their whole axis) in one `slice` call.
    Returns the sliced view (every axis kept, ints as length 1) and its shape."""
    shape = a.shape
    starts, stops, steps, sizes = [], [], [], []
    axis = 0
    for e in entries:
        if e is None:
            continue
        n = shape[axis]
        if type(e) is slice:
            start, stop, step, length = _slice_bounds(e, n)
        elif type(e) is int:
            start = _int_bound(e, n, axis)
            stop, step, length = start + 1, 1, 1
        else:
            start, stop, step, length = 0, n, 1, n
        starts.append(start)
        stops.append(stop)
        steps.append(step)
        sizes.append(length)
        axis += 1
    if sizes == list(shape) and not any(starts) and all(step == 1 for step in steps):
        return a, sizes
    return _g.slice(a, starts, stops, steps), sizes


_c_slice = fast.mlx_slice
_INT_ARRAY = ffi.typeof("int[]")
_squeeze0 = _g.squeeze_axis


_object_new = object.__new__
_SLICES: dict[tuple[int, ...], tuple[Any, Any, Any]] = {}  # bounds -> (starts, stops, strides) buffers


def _slice_first_axis(a: Array, start: int, stop: int, step: int, rest: tuple[int, ...]) -> Array:
    """`slice` of the first axis. Its three int lists live in one buffer, kept by value for reuse
    (the same slices recur in every layer and step; mlx-c only reads them)."""
    key = (start, stop, step, *rest)
    bufs = _SLICES.get(key)
    if bufs is None:
        n = len(rest) + 1
        buf = new_cdata(_INT_ARRAY, (start, *(0,) * (n - 1), stop, *rest, step, *(1,) * (n - 1)))
        if len(_SLICES) >= 4096:
            _SLICES.clear()
        bufs = _SLICES[key] = (buf, buf + n, buf + 2 * n)
    h = a._h
    if h is None:
        freed()
    try:
        s = _device._cache.c
    except AttributeError:
        s = current_stream()
    n = len(rest) + 1
    r = new_cdata(RESULT_SLOT)
    if _c_slice(r, h, bufs[0], n, bufs[1], n, bufs[2], n, s):
        fail(r)
    out = _object_new(Array)
    out._h = gc_cdata(r[0], _free)
    return out


def getitem(self: Array, index: Any) -> Array:
    t = type(index)
    if t is int or t is slice:  # the common a[i] and a[i:j:k]: no normalisation needed
        shape = self.shape
        if not shape:
            raise IndexError("too many indices for array: array is 0-dimensional, but 1 were indexed")
        if t is int:
            start = _int_bound(index, shape[0], 0)
            return _squeeze0(_slice_first_axis(self, start, start + 1, 1, shape[1:]), 0)
        start, stop, step, _ = _slice_bounds(index, shape[0])
        return _slice_first_axis(self, start, stop, step, shape[1:])
    entries = _normalize(index, self.ndim)
    for e in entries:
        if isinstance(e, Array):
            return _advanced(self, entries)
    view, sizes = _basic(self, entries)
    out_shape: list[int] = []
    axis = 0
    for e in entries:
        if e is None:
            out_shape.append(1)
            continue
        if type(e) is slice:
            out_shape.append(sizes[axis])
        axis += 1
    if out_shape != sizes:
        view = _reshape(view, out_shape)
    elif view is self:  # a[...] or a[:]: a new Array (assigning into it must not change `self`)
        view = copy_handle(self)
    return view


def _advanced(a: Array, entries: list[Any]) -> Array:
    """Integer-array indexing (numpy semantics), after the slices are applied."""
    view, sizes = _basic(a, [e if type(e) is not int else slice(None) for e in entries])
    adv_pos = [k for k, e in enumerate(entries) if isinstance(e, (Array, int))]
    adjacent = adv_pos == list(range(adv_pos[0], adv_pos[-1] + 1))
    adv_axes: list[int] = []
    indices: list[Array] = []
    rest_axes: list[int] = []
    axis = 0
    for e in entries:
        if e is None:
            continue
        if isinstance(e, Array):
            _check_index_array(e)
            adv_axes.append(axis)
            indices.append(e)
        elif type(e) is int:
            adv_axes.append(axis)
            indices.append(asarray(_int_bound(e, sizes[axis], axis), _dt.int32))
        else:
            rest_axes.append(axis)
        axis += 1
    perm = adv_axes + rest_axes
    if perm != list(range(len(perm))):
        view = _g.transpose_axes(view, perm)
    if len(indices) > 1:
        indices = _g.broadcast_arrays(indices)
    adv_sizes = [sizes[ax] for ax in adv_axes]
    wide = math.prod(adv_sizes) >= 2**31
    flat = None
    for n, idx in zip(adv_sizes, indices, strict=True):  # one size per index array
        if idx.dtype.kind == "i" or wide:  # negative indices count from the end
            idx = _g.remainder(idx, asarray(n, idx.dtype if not wide else _dt.int64))
        if len(indices) == 1:
            flat = idx
        else:
            idx = ops.astype(idx, _dt.int64 if wide else _dt.int32)
            flat = idx if flat is None else _g.add(_g.multiply(flat, asarray(n, idx.dtype)), idx)
    rest_sizes = [sizes[ax] for ax in rest_axes]
    if len(indices) > 1:  # the index axes lead: merge them, `flat` indexes the merged axis
        view = _g.reshape(view, [math.prod(adv_sizes), *rest_sizes])
    assert flat is not None  # there is at least one index array: `indices` is not empty
    out = _g.take_axis(view, flat, 0)
    # `out` is (broadcast index dims..., rest dims...): move the index block in place and add Nones.
    b_ndim = out.ndim - len(rest_sizes)
    order: list[int] = []  # output axes, as positions in `out`; -1 for a None
    rest = iter(range(b_ndim, out.ndim))
    placed = not adjacent
    if not adjacent:
        order += list(range(b_ndim))
    for e in entries:
        if e is None:
            order.append(-1)
        elif isinstance(e, (Array, int)):
            if not placed:
                order += list(range(b_ndim))
                placed = True
        else:
            order.append(next(rest))
    axes = [k for k in order if k >= 0]
    if axes != list(range(out.ndim)):
        out = _g.transpose_axes(out, axes)
    if -1 in order:
        shape = out.shape
        it = iter(shape)
        out = _g.reshape(out, [1 if k < 0 else next(it) for k in order])
    return out


def setitem(self: Array, index: Any, value: Any) -> None:
    """In-place update: the Array takes the handle of the updated array (MLX arrays are immutable)."""
    dtype = self.dtype
    if isinstance(value, Array):
        value = ops.astype(value, dtype) if value.dtype is not dtype else value
    else:
        value = asarray(value, dtype)
    entries = _normalize(index, self.ndim)
    if any(isinstance(e, Array) for e in entries):
        updated = _scatter_update(self, index, value)
    else:
        shape = self.shape
        starts, stops, steps, slice_shape, indexed_shape = [], [], [], [], []
        axis = 0
        for e in entries:
            if e is None:
                indexed_shape.append(1)
                continue
            n = shape[axis]
            if type(e) is slice:
                start, stop, step, length = _slice_bounds(e, n)
                indexed_shape.append(length)
            else:
                start = _int_bound(e, n, axis)
                stop, step, length = start + 1, 1, 1
            starts.append(start)
            stops.append(stop)
            steps.append(step)
            slice_shape.append(length)
            axis += 1
        # numpy semantics: the value broadcasts against what the index selects.
        update = _broadcast_value(value, indexed_shape)
        if slice_shape != indexed_shape:
            update = _g.reshape(update, slice_shape)
        updated = _g.slice_update(self, update, starts, stops, steps)
    self._take(updated)


def _broadcast_value(value: Array, shape: list[int]) -> Array:
    vshape = value.shape
    while len(vshape) > len(shape) and vshape[0] == 1:  # numpy drops leading 1s of the value
        vshape = vshape[1:]
    if vshape != value.shape:
        value = _g.reshape(value, list(vshape))
    if list(vshape) != shape:
        value = _g.broadcast_to(value, shape)
    return value


def _scatter_update(self: Array, index: Any, value: Array) -> Array:
    """Assignment through integer arrays: index an array of element positions the same way, then
    scatter the values into those positions (any index getitem supports works here)."""
    shape = list(self.shape)
    size = math.prod(shape)
    pos_dtype = _dt.int32 if size < 2**31 else _dt.int64
    positions = _g.reshape(ops.arange(0, size, 1, pos_dtype), shape)
    picked = getitem(positions, index)
    count = picked.size
    flat_idx = _g.reshape(picked, [count])
    updates = _g.reshape(_broadcast_value(value, list(picked.shape)), [count, 1])
    flat = _g.reshape(self, [size])
    return _g.reshape(_g.scatter_single(flat, flat_idx, updates, 0), shape)


Array.__getitem__ = getitem  # type: ignore[method-assign]
Array.__setitem__ = setitem  # type: ignore[method-assign]
