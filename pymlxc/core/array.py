"""`Array`: one Python object owning one mlx_array handle."""
from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import dtypes as _dt
from ._loader import MLXError, check, fast, ffi, gc_cdata, last_error, lib, new_cdata
from .device import current_stream

if TYPE_CHECKING:  # the methods `operators` attaches are the functions of `ops`, which imports this module
    from . import ops as _ops
    from .device import StreamLike

_NULL = ffi.NULL
# Bound once: these run for every op (and `lib.<name>` lookups cost a dict lookup each).
_ARRAY_P = ffi.typeof("mlx_array *")  # a result slot for `lib` calls
RESULT_SLOT = ffi.typeof("void **")  # a result slot for `fast` calls (the same `ctx`, see _loader)
_new = new_cdata
_gc = gc_cdata
_array_free = fast.mlx_array_free
_object_new = object.__new__


def adopt(h: Any) -> Array:
    """An Array owning `h`, an array handle (`void *`, an `mlx_array`'s ctx) taken at +1. It gets
    `mlx_array_free` as its collector destructor: a plain C call, so collecting an array runs no
    Python code."""
    a = _object_new(Array)
    a._h = _gc(h, _array_free)
    return a


def wrap(p: Any) -> Array:
    """Adopt a freshly filled `mlx_array *` slot of a `lib` call (taken at +1). Call after check()."""
    a = _object_new(Array)
    a._h = _gc(p[0].ctx, _array_free)
    return a


def new_handle() -> Any:
    """A zeroed `mlx_array *` result slot for a `lib` call (mlx-c fills a null ctx with a new array)."""
    return _new(_ARRAY_P)


def release_failed(p: Any) -> None:
    """Free a half-made result in an `mlx_array *` slot after a failed call (mlx-c may have set it)."""
    if p[0].ctx != _NULL:
        _array_free(p[0].ctx)
        p[0].ctx = _NULL


def release_failed_result(r: Any) -> None:
    """The same for a `void **` result slot of a `fast` call."""
    if r[0] != _NULL:
        _array_free(r[0])
        r[0] = _NULL


def _own_op(fn: Any, *args: Any) -> Array:
    """One op of the `fast` view whose result is one array, on this thread's stream. The Array's own
    conversions (astype, contiguous, view, a host copy) call mlx-c here rather than through `ops`,
    which is built on this module (so this module never imports it)."""
    r = new_cdata(RESULT_SLOT)
    if fn(r, *args, current_stream()):  # args: array handles (`_ctx`) and plain values
        release_failed_result(r)
        raise MLXError(last_error())
    return adopt(r[0])


def _ctx(a: Array) -> Any:
    h = a._h
    if h is None:
        raise FreedArrayError("array used after free()")
    return h


def _astype(a: Array, dtype: _dt.Dtype) -> Array:
    return _own_op(fast.mlx_astype, _ctx(a), dtype.value)


def _contiguous(a: Array) -> Array:
    return _own_op(fast.mlx_contiguous, _ctx(a), False)


def _view(a: Array, dtype: _dt.Dtype) -> Array:
    return _own_op(fast.mlx_view, _ctx(a), dtype.value)


def _host_copy(a: Array) -> Array:
    """A fresh row-major copy: a + zeros_like(a), as MLX writes a new buffer for it."""
    zeros = _own_op(fast.mlx_zeros_like, _ctx(a))
    return _own_op(fast.mlx_add, _ctx(a), _ctx(zeros))


def as_struct(h: Any) -> Any:
    """The `mlx_array` struct for a handle, to pass to `lib` (the Array must outlive its use)."""
    return _new(_ARRAY_P, [h])[0]


class FreedArrayError(MLXError):
    """An Array was used after `free()`."""


def freed() -> Any:
    raise FreedArrayError("array used after free()")


class Array:
    """An MLX array. Owns its handle: freed when collected, or at once with `free()`/`with`."""

    # `_h`: the owned handle, `void *` (None once freed). `_shape`/`_dtype`: filled on first use; an
    # MLX array never changes either (in-place assignment keeps both).
    __slots__ = ("_h", "_shape", "_dtype", "__weakref__")
    _h: Any
    _shape: tuple[int, ...]
    _dtype: _dt.Dtype
    __array_priority__ = 100

    def __init__(self, value: Any, dtype: _dt.Dtype | str | None = None) -> None:
        made = asarray(value, dtype)
        if made is value:  # already an Array of that dtype: share MLX's data through a new handle
            made = copy_handle(made)
        # Take over the handle of the freshly made array.
        self._h = made._h
        made._h = None

    # ------------------------------------------------------------------ lifetime
    @property
    def handle(self) -> Any:
        """The `mlx_array` struct to pass to mlx-c through `lib`; raises on a freed array. (The
        Array keeps owning it: use it while the Array lives.)"""
        h = self._h
        if h is None:
            raise FreedArrayError("array used after free()")
        return as_struct(h)

    def free(self) -> None:
        """Release the MLX array now. Idempotent; any later use raises FreedArrayError."""
        h = self._h
        if h is not None:
            self._h = None
            _gc(h, None)  # detach the collector's destructor: freed exactly once, here
            _array_free(h)

    @property
    def is_freed(self) -> bool:
        return self._h is None

    def __enter__(self) -> Array:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def _take(self, other: Array) -> None:
        """Become `other` (in-place update): take over its handle; `other` is left empty."""
        h = other._h
        if h is None:
            freed()
        other._h = None
        self._h = h

    # ------------------------------------------------------------------ metadata
    @property
    def shape(self) -> tuple[int, ...]:
        try:
            return self._shape
        except AttributeError:
            pass
        h = self._h
        if h is None:
            freed()
        n = fast.mlx_array_ndim(h)
        shape = self._shape = tuple(ffi.unpack(fast.mlx_array_shape(h), n)) if n else ()
        return shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.size

    @property
    def itemsize(self) -> int:
        return self.dtype.size

    @property
    def dtype(self) -> _dt.Dtype:
        try:
            return self._dtype
        except AttributeError:
            pass
        h = self._h
        if h is None:
            freed()
        dtype = self._dtype = _dt.BY_VALUE[fast.mlx_array_dtype(h)]
        return dtype

    def __len__(self) -> int:
        shape = self.shape
        if not shape:
            raise TypeError("len() of a 0-d array")
        return shape[0]

    def __repr__(self) -> str:
        h = self._h
        if h is None:
            return "array(<freed>)"
        s = ffi.new("mlx_string *")
        check(lib.mlx_array_tostring(s, as_struct(h)))
        try:
            text: str = ffi.string(lib.mlx_string_data(s[0])).decode()
            return text
        finally:
            lib.mlx_string_free(s[0])

    # ------------------------------------------------------------------ evaluation and export
    def eval(self) -> Array:
        h = self._h
        if h is None:
            freed()
        check(fast.mlx_array_eval(h))
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

    def __iter__(self) -> Iterator[Array]:
        for i in range(len(self)):
            yield self[i]

    def __hash__(self) -> int:
        return id(self)

    def __getstate__(self) -> Any:
        raise TypeError("Array cannot be pickled; convert with numpy.asarray first")

    if TYPE_CHECKING:
        # Attached by `operators` at import (the operators are generated flat functions, the methods
        # are the functions of `ops`): declared here for type checkers.
        def __add__(self, other: ArrayLike) -> Array: ...
        def __radd__(self, other: ArrayLike) -> Array: ...
        def __sub__(self, other: ArrayLike) -> Array: ...
        def __rsub__(self, other: ArrayLike) -> Array: ...
        def __mul__(self, other: ArrayLike) -> Array: ...
        def __rmul__(self, other: ArrayLike) -> Array: ...
        def __truediv__(self, other: ArrayLike) -> Array: ...
        def __rtruediv__(self, other: ArrayLike) -> Array: ...
        def __floordiv__(self, other: ArrayLike) -> Array: ...
        def __rfloordiv__(self, other: ArrayLike) -> Array: ...
        def __mod__(self, other: ArrayLike) -> Array: ...
        def __rmod__(self, other: ArrayLike) -> Array: ...
        def __pow__(self, other: ArrayLike) -> Array: ...
        def __rpow__(self, other: ArrayLike) -> Array: ...
        def __matmul__(self, other: ArrayLike) -> Array: ...
        def __rmatmul__(self, other: ArrayLike) -> Array: ...
        def __xor__(self, other: ArrayLike) -> Array: ...
        def __rxor__(self, other: ArrayLike) -> Array: ...
        def __lshift__(self, other: ArrayLike) -> Array: ...
        def __rlshift__(self, other: ArrayLike) -> Array: ...
        def __rshift__(self, other: ArrayLike) -> Array: ...
        def __rrshift__(self, other: ArrayLike) -> Array: ...
        def __and__(self, other: ArrayLike) -> Array: ...
        def __rand__(self, other: ArrayLike) -> Array: ...
        def __or__(self, other: ArrayLike) -> Array: ...
        def __ror__(self, other: ArrayLike) -> Array: ...
        # Elementwise comparisons, as in numpy and mlx.core: object's `-> bool` does not hold.
        def __eq__(self, other: object) -> Array: ...  # type: ignore[override]  # elementwise, not bool
        def __ne__(self, other: object) -> Array: ...  # type: ignore[override]  # elementwise, not bool
        def __lt__(self, other: ArrayLike) -> Array: ...
        def __le__(self, other: ArrayLike) -> Array: ...
        def __gt__(self, other: ArrayLike) -> Array: ...
        def __ge__(self, other: ArrayLike) -> Array: ...
        def __neg__(self) -> Array: ...
        def __pos__(self) -> Array: ...
        def __abs__(self) -> Array: ...
        def __invert__(self) -> Array: ...
        def __getitem__(self, index: Any) -> Array: ...
        def __setitem__(self, index: Any, value: ArrayLike) -> None: ...
        def reshape(self, *shape: int | Sequence[int], stream: StreamLike = None) -> Array: ...
        @property
        def T(self) -> Array: ...

        def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False, *,
                   stream: StreamLike = None) -> Array: ...
        def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False, *,
                    stream: StreamLike = None) -> Array: ...
        def max(self, axis: int | Sequence[int] | None = None, keepdims: bool = False, *,
                   stream: StreamLike = None) -> Array: ...
        def min(self, axis: int | Sequence[int] | None = None, keepdims: bool = False, *,
                   stream: StreamLike = None) -> Array: ...
        def prod(self, axis: int | Sequence[int] | None = None, keepdims: bool = False, *,
                    stream: StreamLike = None) -> Array: ...
        def all(self, axis: int | Sequence[int] | None = None, keepdims: bool = False, *,
                   stream: StreamLike = None) -> Array: ...
        def any(self, axis: int | Sequence[int] | None = None, keepdims: bool = False, *,
                   stream: StreamLike = None) -> Array: ...
        def logsumexp(self, axis: int | Sequence[int] | None = None, keepdims: bool = False, *,
                         stream: StreamLike = None) -> Array: ...
        var = _ops.var
        std = _ops.std
        argmax = _ops.argmax
        argmin = _ops.argmin
        transpose = _ops.transpose
        squeeze = _ops.squeeze
        flatten = _ops.flatten
        swapaxes = _ops.swapaxes
        moveaxis = _ops.moveaxis
        cumsum = _ops.cumsum
        cumprod = _ops.cumprod
        round = _ops.round
        diagonal = _ops.diagonal
        split = _ops.split
        astype = _ops.astype
        abs = _ops.abs
        exp = _ops.exp
        log = _ops.log
        sqrt = _ops.sqrt
        square = _ops.square
        sin = _ops.sin
        cos = _ops.cos
        reciprocal = _ops.reciprocal
        rsqrt = _ops.rsqrt
        conjugate = _ops.conjugate
        sort = _ops.sort
        argsort = _ops.argsort
        softmax = _ops.softmax


# What an array argument accepts: an Array, a numpy array or scalar, a Python scalar (int, float and
# bool are complex to a type checker) or a nested list (see `asarray`).
ArrayLike = Array | np.ndarray[Any, Any] | np.generic | complex | Sequence[Any]


def copy_handle(a: Array) -> Array:
    """A second handle on the same MLX array (MLX arrays share their data)."""
    p = _new(_ARRAY_P)
    check(lib.mlx_array_set(p, a.handle))
    return wrap(p)


# ---------------------------------------------------------------------- creation

_INT_RANGE: dict[_dt.Dtype, tuple[int, int]] = {
    d: (int(np.iinfo(d.name).min), int(np.iinfo(d.name).max)) for d in _dt.ALL if d.is_integer
}
_INT_CTYPE = {d: ffi.typeof(("u" if d.kind == "u" else "") + f"int{8 * d.size}_t[1]") for d in _INT_RANGE}
_U16 = ffi.typeof("uint16_t[1]")
_new_float32 = fast.mlx_array_new_float32
_new_int = fast.mlx_array_new_int
_new_bool = fast.mlx_array_new_bool
_new_data = fast.mlx_array_new_data
_F16_PACK = struct.Struct("<e")
_F32_PACK = struct.Struct("<f")
_U32_UNPACK = struct.Struct("<I")


def _overflow(value: Any, dtype: _dt.Dtype) -> ValueError:
    return ValueError(f"Converting {value} to {dtype.name} would result in overflow.")


def _half_bits(value: float, dtype: _dt.Dtype) -> int:
    """float16/bfloat16 bits of a Python float, rounded through float32 as MLX does."""
    try:
        f32 = _F32_PACK.pack(value)
    except OverflowError:
        f32 = _F32_PACK.pack(math.copysign(math.inf, value))
    if dtype is _dt.float16:
        x = _F32_PACK.unpack(f32)[0]
        try:
            return int.from_bytes(_F16_PACK.pack(x), "little")
        except OverflowError:
            return 0xFC00 if x < 0 else 0x7C00
    bits: int = _U32_UNPACK.unpack(f32)[0]
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x007FFFFF:
        return ((bits >> 16) & 0x8000) | 0x7FC0  # NaN stays a quiet NaN
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even


def scalar_handle(value: Any, dtype: _dt.Dtype) -> Any:
    """A collected `mlx_array` holding the Python scalar `value` as a 0-d array of `dtype`
    (MLX's rules: floats truncate to ints, ints that do not fit raise ValueError)."""
    if dtype is _dt.float32:
        if type(value) is complex:
            raise TypeError("cannot convert a complex scalar to float32")
        return _gc(_new_float32(value), _array_free)
    if dtype.kind in "iu":
        if type(value) is complex:
            raise TypeError(f"cannot convert a complex scalar to {dtype.name}")
        v = int(value)
        lo, hi = _INT_RANGE[dtype]
        if not lo <= v <= hi:
            raise _overflow(value, dtype)
        if dtype is _dt.int32:
            return _gc(_new_int(v), _array_free)
        h = _new_data(_new(_INT_CTYPE[dtype], [v]), _NULL, 0, dtype.value)
    elif dtype is _dt.bool_:
        return _gc(_new_bool(bool(value)), _array_free)
    elif dtype is _dt.float64:
        return _gc(fast.mlx_array_new_float64(float(value)), _array_free)
    elif dtype is _dt.complex64:
        c = complex(value)
        return _gc(fast.mlx_array_new_complex(c.real, c.imag), _array_free)
    else:  # float16, bfloat16
        if type(value) is complex:
            raise TypeError(f"cannot convert a complex scalar to {dtype.name}")
        h = _new_data(_new(_U16, [_half_bits(float(value), dtype)]), _NULL, 0, dtype.value)
    if h == _NULL:
        raise MLXError(last_error())
    return _gc(h, _array_free)


INEXACT_DTYPES = frozenset(d for d in _dt.ALL if d.kind in "fc")


def weak_dtype(dtype: _dt.Dtype, t: type) -> _dt.Dtype:
    """MLX's weak typing of a Python scalar of type `t` next to an array of `dtype`: the scalar takes
    the array's dtype when that holds its kind (float32 array + 1.5 stays float32, int8 + 3 stays
    int8, bool + 3 is int32, int + 1.5 is float32)."""
    if t is float:
        return dtype if dtype in INEXACT_DTYPES else _dt.float32
    if t is int:
        return _dt.int32 if dtype is _dt.bool_ else dtype
    if t is bool:
        return dtype
    return _dt.complex64


def weak_handle(value: Any, dtype: _dt.Dtype) -> Any:
    """The handle of `value` as the operand of an op with an array of `dtype`, converted as mlx.core
    does: Python scalars are weakly typed, numpy scalars and arrays take `dtype`, lists are converted
    as they are. NotImplemented for a type that is no array."""
    t = type(value)
    if t is float or t is int or t is bool or t is complex:
        return scalar_handle(value, weak_dtype(dtype, t))
    if isinstance(value, Array):
        return value._h
    if isinstance(value, (bool, int, float, complex)):  # np.float64 is a float, numpy bools are not
        base: type[Any] = bool if isinstance(value, bool) else int if isinstance(value, int) else \
            float if isinstance(value, float) else complex
        return scalar_handle(base(value), weak_dtype(dtype, base))
    if isinstance(value, np.generic) and value.dtype.kind in "biufc":
        item = value.item()
        return scalar_handle(item, dtype if not isinstance(item, complex) else _dt.complex64)
    if isinstance(value, np.ndarray):
        return asarray(value, dtype)._h
    if isinstance(value, (list, tuple)) or hasattr(value, "__array__"):
        return asarray(value)._h
    return NotImplemented


def _default_int_dtype(value: int) -> _dt.Dtype:
    """MLX's Python ints: int32 when they fit, else int64."""
    if -(2**31) <= value < 2**31:
        return _dt.int32
    if -(2**63) <= value < 2**63:
        return _dt.int64
    raise ValueError(f"Python integer {value} is out of the range of int64")


def scalar(value: Any, dtype: _dt.Dtype | None = None) -> Array:
    """A 0-d array from a Python scalar (bool, int32 or int64 by size, float32, complex64 by default)."""
    if dtype is None:
        t = type(value)
        if t is float:
            dtype = _dt.float32
        elif t is int:
            dtype = _default_int_dtype(value)
        elif t is bool:
            dtype = _dt.bool_
        elif t is complex:
            dtype = _dt.complex64
        elif isinstance(value, np.generic):
            return _from_numpy(np.asarray(value), None)
        elif isinstance(value, bool):
            dtype = _dt.bool_
        elif isinstance(value, numbers.Integral):
            value = int(value)
            dtype = _default_int_dtype(value)
        elif isinstance(value, numbers.Real):
            value = float(value)
            dtype = _dt.float32
        elif isinstance(value, numbers.Complex):
            value = complex(value)
            dtype = _dt.complex64
        else:
            raise TypeError(f"cannot make an MLX array from {type(value).__name__}")
    elif isinstance(value, np.generic):
        value = value.item()
    a = _object_new(Array)
    a._h = scalar_handle(value, dtype)
    return a


def _native(arr: np.ndarray) -> np.ndarray:
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


# numpy's dtypes that MLX narrows by default (as mlx.core.array does): no float64 on GPUs.
_NUMPY_DEFAULT = {np.dtype(np.float64): _dt.float32, np.dtype(np.complex128): _dt.complex64}


def _from_numpy(arr: np.ndarray, dtype: _dt.Dtype | None) -> Array:
    arr = _native(arr)
    src = _dt.from_numpy(arr.dtype)
    if dtype is None:
        dtype = _NUMPY_DEFAULT.get(arr.dtype, src)
    # (np.asarray with order="C", not np.ascontiguousarray: that one turns 0-d arrays into 1-d.)
    if src is _dt.bfloat16:  # ml_dtypes' bfloat16: hand MLX the bits
        data = np.asarray(arr, order="C").view(np.uint16)
    elif dtype is not src:  # convert on the numpy side (to float32 first for bfloat16)
        data = np.asarray(arr, dtype=dtype.numpy, order="C")
        src = _dt.from_numpy(data.dtype)
    elif src is _dt.complex64 and arr.dtype != np.complex64:
        data = np.asarray(arr, dtype=np.complex64, order="C")
    else:
        data = np.asarray(arr, order="C")
    for dim in data.shape:
        if dim > 2**31 - 1:
            raise ValueError(f"dimension {dim} is larger than MLX supports")
    shape = ffi.new("int[]", list(data.shape)) if data.ndim else _NULL
    h = _new_data(ffi.from_buffer(data), shape, data.ndim, src.value)  # MLX copies the data
    if h == _NULL:
        raise MLXError(last_error())
    out = adopt(h)
    if dtype is not src:
        out = _astype(out, dtype)
    return out


def asarray(value: Any, dtype: _dt.Dtype | str | None = None) -> Array:
    """Make an Array from an Array, a Python scalar, a nested list, or a numpy array."""
    t = type(value)
    if dtype is None:
        if t is Array:
            same: Array = value
            return same
        if t is float:  # the common mx.array(0.5): one C call
            a = _object_new(Array)
            a._h = _gc(_new_float32(value), _array_free)
            return a
    else:
        dtype = _dt.as_dtype(dtype)
    if t is float or t is int or t is bool or t is complex:
        return scalar(value, dtype)
    if isinstance(value, Array):
        if dtype is None or value.dtype is dtype:
            return value
        return _astype(value, dtype)
    if isinstance(value, np.ndarray):
        return _from_numpy(value, dtype)
    if isinstance(value, (numbers.Number, np.generic)):
        return scalar(value, dtype)
    if isinstance(value, (list, tuple)):
        return _from_list(value, dtype)
    if hasattr(value, "__array__"):
        return _from_numpy(np.asarray(value), dtype)
    raise TypeError(f"cannot make an MLX array from {type(value).__name__}")


def _from_list(value: Sequence[Any], dtype: _dt.Dtype | None) -> Array:
    try:
        arr = np.asarray(value)
    except (ValueError, OverflowError, TypeError) as exc:
        raise ValueError(f"cannot make an array from this list: {exc}") from exc
    if arr.dtype.kind in "USOV":
        raise ValueError("nested lists must be rectangular and hold numbers only")
    if dtype is None and arr.dtype == np.int64:  # MLX: int32 unless a value needs int64
        fits = arr.size == 0 or (int(arr.min()) >= -(2**31) and int(arr.max()) < 2**31)
        dtype = _dt.int32 if fits else _dt.int64
    return _from_numpy(arr, dtype)


# ---------------------------------------------------------------------- export

_DATA_FN = {
    "bool": "mlx_array_data_bool", "uint8": "mlx_array_data_uint8", "uint16": "mlx_array_data_uint16",
    "uint32": "mlx_array_data_uint32", "uint64": "mlx_array_data_uint64", "int8": "mlx_array_data_int8",
    "int16": "mlx_array_data_int16", "int32": "mlx_array_data_int32", "int64": "mlx_array_data_int64",
    "float16": "mlx_array_data_float16", "float32": "mlx_array_data_float32",
    "float64": "mlx_array_data_float64", "bfloat16": "mlx_array_data_bfloat16",
    "complex64": "mlx_array_data_complex64",
}


def to_numpy(a: Array) -> np.ndarray[Any, Any]:
    """Copy an array's values into a new numpy array (row-major; bfloat16 widens to float32)."""
    h = a.handle
    flag = ffi.new("bool *")
    check(lib._mlx_array_is_row_contiguous(flag, h))
    src = a
    if not flag[0]:
        src = _contiguous(a)
    check(lib.mlx_array_eval(src.handle))
    check(lib._mlx_array_is_row_contiguous(flag, src.handle))
    if not flag[0]:  # evaluated views of broadcasts can still be strided: force a copy
        src = _host_copy(src)
        check(lib.mlx_array_eval(src.handle))
    dtype = a.dtype
    shape = a.shape
    size = a.size
    if size == 0:
        return np.zeros(shape, dtype=dtype.numpy)
    if dtype is _dt.float16 or dtype is _dt.bfloat16:
        # Half types have no data accessor on every platform: read their bits as uint16.
        src = _view(src, _dt.uint16)
        check(lib.mlx_array_eval(src.handle))
        ptr = lib.mlx_array_data_uint16(src.handle)
    else:
        ptr = getattr(lib, _DATA_FN[dtype.name])(src.handle)
    if ptr == _NULL:
        raise MLXError("array data is not available on the host")
    raw = ffi.buffer(ptr, size * dtype.size)
    out: np.ndarray[Any, Any]
    if dtype is _dt.bfloat16:
        bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
        out = bits.view(np.float32).reshape(shape)
    elif dtype is _dt.float16:
        out = np.frombuffer(raw, dtype=np.uint16).view(np.float16).reshape(shape).copy()
    else:
        out = np.frombuffer(raw, dtype=np.dtype(dtype.name)).reshape(shape).copy()
    return out


__all__ = [
    "Array", "ArrayLike", "asarray", "scalar", "scalar_handle", "weak_dtype", "weak_handle", "to_numpy", "wrap",
    "adopt",
    "new_handle", "release_failed", "release_failed_result", "as_struct",
    "freed", "FreedArrayError", "current_stream", "copy_handle", "RESULT_SLOT", "INEXACT_DTYPES",
]
