"""MLX dtypes as Python objects, with their numpy counterparts."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._loader import lib


@dataclass(frozen=True)
class Dtype:
    name: str
    value: int  # mlx_dtype enum value
    size: int  # bytes per element
    kind: str  # "b" bool, "u" unsigned, "i" signed, "f" floating, "c" complex

    def __repr__(self) -> str:
        return f"pymlxc.{self.name}"

    @property
    def is_floating(self) -> bool:
        return self.kind == "f"

    @property
    def is_integer(self) -> bool:
        return self.kind in ("u", "i")

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype that holds this dtype's values (bfloat16 widens to float32)."""
        return _TO_NUMPY[self.name]


def _make(name: str, enum: str, size: int, kind: str) -> Dtype:
    return Dtype(name, int(getattr(lib, enum)), size, kind)


bool_ = _make("bool", "MLX_BOOL", 1, "b")
uint8 = _make("uint8", "MLX_UINT8", 1, "u")
uint16 = _make("uint16", "MLX_UINT16", 2, "u")
uint32 = _make("uint32", "MLX_UINT32", 4, "u")
uint64 = _make("uint64", "MLX_UINT64", 8, "u")
int8 = _make("int8", "MLX_INT8", 1, "i")
int16 = _make("int16", "MLX_INT16", 2, "i")
int32 = _make("int32", "MLX_INT32", 4, "i")
int64 = _make("int64", "MLX_INT64", 8, "i")
float16 = _make("float16", "MLX_FLOAT16", 2, "f")
float32 = _make("float32", "MLX_FLOAT32", 4, "f")
float64 = _make("float64", "MLX_FLOAT64", 8, "f")
bfloat16 = _make("bfloat16", "MLX_BFLOAT16", 2, "f")
complex64 = _make("complex64", "MLX_COMPLEX64", 8, "c")

ALL: tuple[Dtype, ...] = (
    bool_, uint8, uint16, uint32, uint64, int8, int16, int32, int64,
    float16, float32, float64, bfloat16, complex64,
)
BY_VALUE: dict[int, Dtype] = {d.value: d for d in ALL}
BY_NAME: dict[str, Dtype] = {d.name: d for d in ALL}
BY_NAME["bool_"] = bool_

_TO_NUMPY: dict[str, np.dtype] = {
    d.name: np.dtype(d.name if d.name != "bfloat16" else "float32") for d in ALL
}
_FROM_NUMPY: dict[np.dtype, Dtype] = {np.dtype(d.name): d for d in ALL if d.name != "bfloat16"}


def from_numpy(dtype: np.dtype) -> Dtype:
    """The MLX dtype for a numpy dtype; ml_dtypes' bfloat16 is recognised by name."""
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return bfloat16
    if dtype == np.complex128:
        return complex64
    try:
        return _FROM_NUMPY[dtype]
    except KeyError:
        raise TypeError(f"numpy dtype {dtype} has no MLX equivalent") from None


# What a `dtype=` argument accepts: a Dtype, its name, a numpy dtype, or bool/int/float.
DtypeLike = Dtype | str | np.dtype[Any] | type


def as_dtype(value: DtypeLike) -> Dtype:
    if isinstance(value, Dtype):
        return value
    if isinstance(value, str) and value in BY_NAME:
        return BY_NAME[value]
    if value is bool:
        return bool_
    if value is int:
        return int32
    if value is float:
        return float32
    return from_numpy(np.dtype(value))


def promote_scalar(dtype: Dtype, scalar: object) -> Dtype:
    """MLX's weak typing of Python scalars: they take the array's dtype when it can hold them."""
    if isinstance(scalar, bool):
        return dtype
    if isinstance(scalar, int):
        return int32 if dtype is bool_ else dtype
    if isinstance(scalar, float):
        return dtype if dtype.kind in ("f", "c") else float32
    if isinstance(scalar, complex):
        return complex64
    raise TypeError(f"unsupported scalar {scalar!r}")
