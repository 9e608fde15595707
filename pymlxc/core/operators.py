"""Python operators, indexing and slice assignment for `Array` (attached at import)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import dtypes as _dt
from ._gen import RAW, handle_of
from ._loader import check, lib
from .array import Array, asarray
from . import ops

_add, _sub, _mul, _div = RAW["add"], RAW["subtract"], RAW["multiply"], RAW["divide"]


def _pair(a: Array, b: Any) -> tuple[Array, Array]:
    """Bring a Python scalar or list to an Array with MLX's weak scalar typing."""
    if type(b) is Array:
        return a, b
    if isinstance(b, (bool, int, float, complex)):
        return a, asarray(b, _dt.promote_scalar(a.dtype, b))
    return a, asarray(b)


def _binary(op: Callable[..., Array]) -> tuple[Callable[..., Array], Callable[..., Array]]:
    def forward(self: Array, other: Any) -> Array:
        a, b = _pair(self, other)
        return op(a, b)

    def reverse(self: Array, other: Any) -> Array:
        a, b = _pair(self, other)
        return op(b, a)

    return forward, reverse


for _dunder, _name in [
    ("add", "add"), ("sub", "subtract"), ("mul", "multiply"), ("truediv", "divide"),
    ("floordiv", "floor_divide"), ("mod", "remainder"), ("pow", "power"), ("matmul", "matmul"),
    ("and", "logical_and"), ("or", "logical_or"), ("xor", "bitwise_xor"),
    ("lshift", "left_shift"), ("rshift", "right_shift"),
]:
    _fwd, _rev = _binary(RAW[_name])
    setattr(Array, f"__{_dunder}__", _fwd)
    setattr(Array, f"__r{_dunder}__", _rev)

for _dunder, _name in [("eq", "equal"), ("ne", "not_equal"), ("lt", "less"), ("le", "less_equal"),
                       ("gt", "greater"), ("ge", "greater_equal")]:
    setattr(Array, f"__{_dunder}__", _binary(RAW[_name])[0])


def _and(self: Array, other: Any) -> Array:
    a, b = _pair(self, other)
    return RAW["logical_and"](a, b) if a.dtype is _dt.bool_ and b.dtype is _dt.bool_ else RAW["bitwise_and"](a, b)


def _or(self: Array, other: Any) -> Array:
    a, b = _pair(self, other)
    return RAW["logical_or"](a, b) if a.dtype is _dt.bool_ and b.dtype is _dt.bool_ else RAW["bitwise_or"](a, b)


Array.__and__ = _and  # type: ignore[method-assign]
Array.__rand__ = _and  # type: ignore[method-assign]
Array.__or__ = _or  # type: ignore[method-assign]
Array.__ror__ = _or  # type: ignore[method-assign]
Array.__neg__ = lambda self: RAW["negative"](self)  # type: ignore[method-assign]
Array.__pos__ = lambda self: self  # type: ignore[method-assign]
Array.__abs__ = lambda self: RAW["abs"](self)  # type: ignore[method-assign]
Array.__invert__ = lambda self: (  # type: ignore[method-assign]
    RAW["logical_not"](self) if self.dtype is _dt.bool_ else RAW["bitwise_invert"](self)
)
Array.__hash__ = lambda self: id(self)  # type: ignore[method-assign]


# ---------------------------------------------------------------------- methods mirroring mlx.core.array

def _method(fn: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: Array, *args: Any, **kwargs: Any) -> Any:
        return fn(self, *args, **kwargs)

    method.__name__ = fn.__name__
    method.__doc__ = fn.__doc__
    return method


for _name in ["sum", "mean", "max", "min", "prod", "all", "any", "var", "std", "argmax", "argmin", "logsumexp",
              "transpose", "squeeze", "flatten", "swapaxes", "moveaxis", "cumsum", "cumprod", "round",
              "diagonal", "split", "astype", "abs", "exp", "log", "sqrt", "square", "sin", "cos", "reciprocal",
              "rsqrt", "conjugate", "sort", "argsort", "softmax"]:
    setattr(Array, _name, _method(getattr(ops, _name)))


def _reshape(self: Array, *shape: Any, stream: Any = None) -> Array:
    if len(shape) == 1 and not isinstance(shape[0], int):
        shape = tuple(shape[0])
    return ops.reshape(self, shape, stream=stream)


Array.reshape = _reshape  # type: ignore[attr-defined]
Array.T = property(lambda self: RAW["transpose"](self))  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- indexing

def _normalize(index: Any, ndim: int) -> list[Any]:
    """Expand Ellipsis; return a list of int / slice / None / Array entries covering every axis."""
    if not isinstance(index, tuple):
        index = (index,)
    items = [asarray(i) if isinstance(i, list) else i for i in index]
    for i in items:
        if not (i is None or i is Ellipsis or isinstance(i, (int, slice, Array)) or hasattr(i, "__index__")):
            raise IndexError(f"unsupported index {i!r}: use ints, slices, None, Ellipsis or integer arrays")
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    if sum(1 for i in items if i is Ellipsis) > 1:
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


def _basic(a: Array, entries: list[Any]) -> tuple[Array, list[Any]]:
    """Apply ints, slices and None; return the view and the array indices left with their axes."""
    shape = a.shape
    starts, stops, steps = [], [], []
    squeeze_axes: list[int] = []
    advanced: list[tuple[int, Array]] = []
    out_axis = 0
    new_axes: list[int] = []
    axis = 0
    for e in entries:
        if e is None:
            new_axes.append(out_axis)
            out_axis += 1
            continue
        n = shape[axis]
        if isinstance(e, slice):
            start, stop, step = e.indices(n)
            if step < 0 and stop == -1:
                stop = -n - 1  # MLX reads a negative stop relative to the end
            starts.append(start)
            stops.append(stop)
            steps.append(step)
            out_axis += 1
        elif isinstance(e, Array):
            starts.append(0)
            stops.append(n)
            steps.append(1)
            advanced.append((axis, e))
            out_axis += 1
        else:
            i = int(e)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for axis {axis} with size {n}")
            i %= n
            starts.append(i)
            stops.append(i + 1)
            steps.append(1)
            squeeze_axes.append(axis)
        axis += 1
    view = a
    if any(s != 0 for s in starts) or list(stops) != list(shape) or any(s != 1 for s in steps):
        view = RAW["slice"](a, starts, stops, steps)
    # Bring advanced indices first (for the gather below), squeeze ints, then add Nones.
    return view, [squeeze_axes, advanced, new_axes]


def getitem(self: Array, index: Any) -> Array:
    entries = _normalize(index, self.ndim)
    view, (squeeze_axes, advanced, new_axes) = _basic(self, entries)
    if advanced:
        view = _gather_advanced(view, advanced, squeeze_axes)
        squeeze_axes = []
    if squeeze_axes:
        view = RAW["squeeze_axes"](view, squeeze_axes)
    if new_axes:
        view = RAW["expand_dims_axes"](view, new_axes) if not advanced else view
    return view


def _gather_advanced(view: Array, advanced: list[tuple[int, Array]], squeeze_axes: list[int]) -> Array:
    """Integer-array indexing: one array takes along its axis; several broadcast together (numpy rules
    for adjacent array indices: the broadcast index shape replaces those axes in place)."""
    # Drop int-indexed axes first, renumbering the array axes.
    if squeeze_axes:
        view = RAW["squeeze_axes"](view, squeeze_axes)
        advanced = [(ax - sum(1 for s in squeeze_axes if s < ax), idx) for ax, idx in advanced]
    shape = view.shape
    for ax, idx in advanced:
        if idx.dtype is _dt.bool_:
            raise IndexError("boolean mask indexing has a data-dependent shape, which MLX does not support")
        if not idx.dtype.is_integer:
            raise IndexError(f"arrays used as indices must be integers, not {idx.dtype.name}")
    if len(advanced) == 1:
        ax, idx = advanced[0]
        idx = RAW["remainder"](idx, asarray(shape[ax], idx.dtype)) if idx.dtype.kind == "i" else idx
        return RAW["take_axis"](view, idx, ax)
    axes = [ax for ax, _ in advanced]
    if axes != list(range(axes[0], axes[0] + len(axes))):
        raise IndexError("non-adjacent integer array indices are not supported")
    idxs = RAW["broadcast_arrays"]([i for _, i in advanced])
    flat = None
    for (ax, _), idx in zip(advanced, idxs):
        idx = ops.astype(RAW["remainder"](idx, asarray(shape[ax], idx.dtype)), _dt.int32)
        flat = idx if flat is None else RAW["add"](RAW["multiply"](flat, asarray(shape[ax], _dt.int32)), idx)
    merged = list(shape[: axes[0]]) + [-1] + list(shape[axes[-1] + 1:])
    return RAW["take_axis"](ops.reshape(view, merged), flat, axes[0])


def setitem(self: Array, index: Any, value: Any) -> None:
    """In-place update: the handle is replaced by the updated array (MLX arrays are immutable)."""
    value = asarray(value, self.dtype) if not isinstance(value, Array) else ops.astype(value, self.dtype)
    entries = _normalize(index, self.ndim)
    if any(isinstance(e, Array) for e in entries):
        updated = _scatter_update(self, entries, value)
    else:
        shape = self.shape
        starts, stops, steps, target_shape = [], [], [], []
        axis = 0
        for e in entries:
            if e is None:
                continue
            n = shape[axis]
            if isinstance(e, slice):
                start, stop, step = e.indices(n)
                if step < 0 and stop == -1:
                    stop = -n - 1
                starts.append(start)
                stops.append(stop)
                steps.append(step)
                target_shape.append(len(range(start, stop if stop >= -n else -1, step)))
            else:
                i = int(e)
                if not -n <= i < n:
                    raise IndexError(f"index {i} is out of bounds for axis {axis} with size {n}")
                i %= n
                starts.append(i)
                stops.append(i + 1)
                steps.append(1)
                target_shape.append(1)
            axis += 1
        update = ops.broadcast_to(_drop_leading_ones(value, len(target_shape)), target_shape)
        updated = RAW["slice_update"](self, update, starts, stops, steps)
    check(lib.mlx_array_set(self._p, handle_of(updated)))


def _drop_leading_ones(value: Array, ndim: int) -> Array:
    shape = value.shape
    while len(shape) > ndim and shape[0] == 1:
        shape = shape[1:]
    return ops.reshape(value, shape) if shape != value.shape else value


def _scatter_update(self: Array, entries: list[Any], value: Array) -> Array:
    if len([e for e in entries if e is not None]) != self.ndim or sum(isinstance(e, Array) for e in entries) != 1:
        raise IndexError("assignment with an integer array supports one array index plus full slices")
    axis = next(i for i, e in enumerate(e for e in entries if e is not None) if isinstance(e, Array))
    others = [e for i, e in enumerate(e for e in entries if e is not None) if i != axis]
    if any(not (isinstance(e, slice) and e == slice(None)) for e in others):
        raise IndexError("assignment with an integer array supports one array index plus full slices")
    idx = next(e for e in entries if isinstance(e, Array))
    idx = ops.reshape(idx, [-1])
    shape = list(self.shape)
    upd_shape = [idx.size] + shape[:axis] + shape[axis + 1:]
    slice_shape = [1 if i == axis else s for i, s in enumerate(shape)]
    moved = ops.moveaxis(ops.broadcast_to(value, shape[:axis] + [idx.size] + shape[axis + 1:]), axis, 0)
    updates = ops.reshape(moved, [idx.size] + slice_shape)
    del upd_shape
    return RAW["scatter_single"](self, idx, updates, axis)


Array.__getitem__ = getitem  # type: ignore[method-assign]
Array.__setitem__ = setitem  # type: ignore[method-assign]
