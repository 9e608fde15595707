"""`Array`: one Python object owning one mlx_array handle."""
from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from . import dtypes as _dt
from ._loader import MLXError, check, ffi, lib
from .device import _state, default_stream

_NULL = ffi.NULL


def _free_handle(p: Any) -> None:
    if p[0].ctx != _NULL:
        lib.mlx_array_free(p[0])
        p[0].ctx = _NULL


def wrap(p: Any) -> "Array":
    """Adopt a freshly filled `mlx_array *` (taken at +1) as an Array. Call only after check()."""
    a = Array.__new__(Array)
    a._p = ffi.gc(p, _free_handle)
    return a


def new_handle() -> Any:
    """A zeroed result slot for an mlx-c call (mlx-c fills a null ctx with a new array)."""
    return ffi.new("mlx_array *")


def release_failed(p: Any) -> None:
    """Free a half-made result after a failed call (mlx-c may have set it)."""
    if p[0].ctx != _NULL:
        lib.mlx_array_free(p[0])
        p[0].ctx = _NULL


class FreedArrayError(MLXError):
    """An Array was used after `free()`."""


class Array:
    """An MLX array. Owns its handle: freed when collected, or at once with `free()`/`with`."""

    __slots__ = ("_p", "__weakref__")
    __array_priority__ = 100

    def __init__(self, value: Any, dtype: _dt.Dtype | str | None = None) -> None:
        made = asarray(value, dtype)
        # Take over the handle of the freshly made array.
        self._p = made._p
        made._p = None

    # ------------------------------------------------------------------ lifetime
    @property
    def handle(self) -> Any:
        """The `mlx_array` struct to pass to mlx-c; raises on a freed array."""
        p = self._p
        if p is None:
            raise FreedArrayError("array used after free()")
        return p[0]

    def free(self) -> None:
        """Release the MLX array now. Idempotent; any later use raises FreedArrayError."""
        p = self._p
        if p is not None:
            self._p = None
            ffi.gc(p, None)
            _free_handle(p)

    @property
    def is_freed(self) -> bool:
        return self._p is None

    def __enter__(self) -> "Array":
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    # ------------------------------------------------------------------ metadata
    @property
    def shape(self) -> tuple[int, ...]:
        h = self.handle
        n = lib.mlx_array_ndim(h)
        if n == 0:
            return ()
        return tuple(ffi.unpack(lib.mlx_array_shape(h), n))

    @property
    def ndim(self) -> int:
        return lib.mlx_array_ndim(self.handle)

    @property
    def size(self) -> int:
        return lib.mlx_array_size(self.handle)

    @property
    def nbytes(self) -> int:
        return lib.mlx_array_nbytes(self.handle)

    @property
    def itemsize(self) -> int:
        return lib.mlx_array_itemsize(self.handle)

    @property
    def dtype(self) -> _dt.Dtype:
        return _dt.BY_VALUE[lib.mlx_array_dtype(self.handle)]

    def __len__(self) -> int:
        shape = self.shape
        if not shape:
            raise TypeError("len() of a 0-d array")
        return shape[0]

    def __repr__(self) -> str:
        if self._p is None:
            return "array(<freed>)"
        s = ffi.new("mlx_string *")
        check(lib.mlx_array_tostring(s, self._p[0]))
        try:
            return ffi.string(lib.mlx_string_data(s[0])).decode()
        finally:
            lib.mlx_string_free(s[0])

    # ------------------------------------------------------------------ evaluation and export
    def eval(self) -> "Array":
        check(lib.mlx_array_eval(self.handle))
        return self

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = to_numpy(self)
        return out.astype(dtype, copy=False) if dtype is not None else out

    def tolist(self) -> Any:
        out = to_numpy(self)
        return out.tolist()

    def item(self) -> Any:
        if self.size != 1:
            raise ValueError(f"item() needs an array of size 1, not shape {self.shape}")
        return to_numpy(self).reshape(()).item()

    def __bool__(self) -> bool:
        return bool(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __index__(self) -> int:
        if not self.dtype.is_integer:
            raise TypeError("only integer arrays can be used as an index")
        return int(self.item())

    def __iter__(self) -> Iterable["Array"]:
        for i in range(len(self)):
            yield self[i]

    def __hash__(self) -> int:
        return id(self)

    def __getstate__(self) -> Any:
        raise TypeError("Array cannot be pickled; convert with numpy.asarray first")


# ---------------------------------------------------------------------- creation

_SCALAR_DTYPE = {bool: _dt.bool_, int: _dt.int32, float: _dt.float32, complex: _dt.complex64}


def _from_numpy(arr: np.ndarray, dtype: _dt.Dtype | None) -> Array:
    src = _dt.from_numpy(arr.dtype)
    target = dtype or src
    if src is _dt.bfloat16:
        data = np.ascontiguousarray(arr).view(np.uint16)
    elif arr.dtype == np.complex128:
        data = np.ascontiguousarray(arr, dtype=np.complex64)
    else:
        data = np.ascontiguousarray(arr)
    shape = ffi.new("int[]", list(data.shape)) if data.ndim else ffi.NULL
    for dim in data.shape:
        if dim > 2**31 - 1:
            raise ValueError(f"dimension {dim} is larger than MLX supports")
    h = lib.mlx_array_new_data(ffi.from_buffer(data), shape, data.ndim, src.value)
    p = new_handle()
    p[0] = h
    out = wrap(p)
    if target is not src:
        from .ops import astype

        out = astype(out, target)
    return out


def scalar(value: Any, dtype: _dt.Dtype | None = None) -> Array:
    """A 0-d array from a Python scalar (int defaults to int32, float to float32)."""
    p = new_handle()
    if dtype is None:
        dtype = _SCALAR_DTYPE.get(type(value))
        if dtype is None:
            if isinstance(value, np.generic):
                return _from_numpy(np.asarray(value), None)
            if isinstance(value, numbers.Integral):
                dtype = _dt.int32
            elif isinstance(value, numbers.Real):
                dtype = _dt.float32
            else:
                raise TypeError(f"cannot make an MLX array from {type(value).__name__}")
    if dtype is _dt.float32:
        p[0] = lib.mlx_array_new_float32(value)
    elif dtype is _dt.bool_:
        p[0] = lib.mlx_array_new_bool(bool(value))
    elif dtype is _dt.int32 and -(2**31) <= value < 2**31:
        p[0] = lib.mlx_array_new_int(int(value))
    elif dtype is _dt.float64:
        p[0] = lib.mlx_array_new_float64(value)
    elif dtype is _dt.complex64:
        c = complex(value)
        p[0] = lib.mlx_array_new_complex(c.real, c.imag)
    else:
        return _from_numpy(np.asarray(value, dtype=dtype.numpy), dtype)
    return wrap(p)


def asarray(value: Any, dtype: _dt.Dtype | str | None = None) -> Array:
    """Make an Array from an Array, a Python scalar, a nested list, or a numpy array."""
    if dtype is not None:
        dtype = _dt.as_dtype(dtype)
    if isinstance(value, Array):
        if dtype is None or value.dtype is dtype:
            return value
        from .ops import astype

        return astype(value, dtype)
    if isinstance(value, np.ndarray):
        return _from_numpy(value, dtype)
    if isinstance(value, (bool, int, float, complex, np.generic)):
        return scalar(value, dtype)
    if isinstance(value, (list, tuple)):
        np_dtype = None
        if dtype is None:
            flat = _flatten_kinds(value)
            np_dtype = (
                np.complex64 if complex in flat else np.float32 if float in flat
                else np.int32 if int in flat else np.bool_ if bool in flat else np.float32
            )
        elif dtype is not _dt.bfloat16:
            np_dtype = dtype.numpy
        try:
            arr = np.asarray(value, dtype=np_dtype)
        except (ValueError, OverflowError) as exc:
            raise ValueError(f"cannot make an array from this list: {exc}") from exc
        if arr.dtype == object:
            raise ValueError("nested lists must be rectangular and hold numbers only")
        return _from_numpy(arr, dtype)
    if hasattr(value, "__array__"):
        return _from_numpy(np.asarray(value), dtype)
    raise TypeError(f"cannot make an MLX array from {type(value).__name__}")


def _flatten_kinds(value: Sequence[Any]) -> set[type]:
    kinds: set[type] = set()
    stack: list[Any] = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, Array):
            kinds.add(float if v.dtype.is_floating else int)
        elif isinstance(v, bool):
            kinds.add(bool)
        elif isinstance(v, numbers.Integral):
            kinds.add(int)
        elif isinstance(v, numbers.Real):
            kinds.add(float)
        elif isinstance(v, numbers.Complex):
            kinds.add(complex)
    return kinds


# ---------------------------------------------------------------------- export

_DATA_FN = {
    "bool": "mlx_array_data_bool", "uint8": "mlx_array_data_uint8", "uint16": "mlx_array_data_uint16",
    "uint32": "mlx_array_data_uint32", "uint64": "mlx_array_data_uint64", "int8": "mlx_array_data_int8",
    "int16": "mlx_array_data_int16", "int32": "mlx_array_data_int32", "int64": "mlx_array_data_int64",
    "float16": "mlx_array_data_float16", "float32": "mlx_array_data_float32",
    "float64": "mlx_array_data_float64", "bfloat16": "mlx_array_data_bfloat16",
    "complex64": "mlx_array_data_complex64",
}


def to_numpy(a: Array) -> np.ndarray:
    """Copy an array's values into a new numpy array (row-major; bfloat16 widens to float32)."""
    from .ops import contiguous

    h = a.handle
    flag = ffi.new("bool *")
    check(lib._mlx_array_is_row_contiguous(flag, h))
    src = a
    if not flag[0]:
        src = contiguous(a)
    check(lib.mlx_array_eval(src.handle))
    check(lib._mlx_array_is_row_contiguous(flag, src.handle))
    if not flag[0]:  # evaluated views of broadcasts can still be strided: force a copy
        from .ops import add, zeros_like

        src = add(src, zeros_like(src))
        check(lib.mlx_array_eval(src.handle))
    dtype = a.dtype
    shape = a.shape
    size = a.size
    if size == 0:
        return np.zeros(shape, dtype=dtype.numpy)
    if dtype is _dt.float16 or dtype is _dt.bfloat16:
        # Half types have no data accessor on every platform: read their bits as uint16.
        from .ops import view

        src = view(src, _dt.uint16)
        check(lib.mlx_array_eval(src.handle))
        ptr = lib.mlx_array_data_uint16(src.handle)
    else:
        ptr = getattr(lib, _DATA_FN[dtype.name])(src.handle)
    if ptr == _NULL:
        raise MLXError("array data is not available on the host")
    raw = ffi.buffer(ptr, size * dtype.size)
    if dtype is _dt.bfloat16:
        bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
        out = bits.view(np.float32).reshape(shape)
    elif dtype is _dt.float16:
        out = np.frombuffer(raw, dtype=np.uint16).view(np.float16).reshape(shape).copy()
    else:
        out = np.frombuffer(raw, dtype=np.dtype(dtype.name)).reshape(shape).copy()
    return out


def _current_stream_c() -> Any:
    return default_stream()._c


__all__ = ["Array", "asarray", "scalar", "to_numpy", "wrap", "new_handle", "FreedArrayError", "_state"]
