"""Shared hypothesis settings and strategies for the binding tests."""
from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pymlxc.core as mx

# Every property test runs few, varied examples: the whole binding suite stays within about a minute
# on two cores. `deadline=None`: the first call of an op can be slow (MLX builds its kernels).
FAST = settings(
    max_examples=40, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
FEWER = settings(FAST, max_examples=15)

FLOAT_DTYPES = ["float32", "float16", "bfloat16"]
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
ALL_NAMES = ["bool", *INT_DTYPES, "float16", "bfloat16", "float32", "float64", "complex64"]

shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)
nonempty_shapes = hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=5)


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype that holds values of an MLX dtype (bfloat16 values live in float32)."""
    return np.dtype("float32" if name == "bfloat16" else name)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest even), kept in float32."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def elements(name: str, lo: float = -50, hi: float = 50) -> st.SearchStrategy[Any]:
    if name == "bool":
        return st.booleans()
    if name in INT_DTYPES:
        info = np.iinfo(name)
        return st.integers(max(int(info.min), int(lo)), min(int(info.max), int(hi)))
    width = 16 if name == "float16" else 32 if name in ("float32", "bfloat16", "complex64") else 64
    narrow = {16: np.float16, 32: np.float32, 64: np.float64}[width]
    lo, hi = float(narrow(lo)), float(narrow(hi))  # bounds must be exact in the width
    return st.floats(lo, hi, width=width, allow_nan=False, allow_infinity=False)


def np_arrays(name: str, shape: Any = shapes, lo: float = -50, hi: float = 50) -> st.SearchStrategy[np.ndarray]:
    """numpy arrays of the values of MLX dtype `name` (bfloat16: float32 values exact in bfloat16)."""
    if name == "complex64":
        real = hnp.arrays(np.float32, shape, elements=elements("float32", lo, hi))
        return real.flatmap(lambda r: hnp.arrays(np.float32, r.shape, elements=elements("float32", lo, hi))
                            .map(lambda i: (r + 1j * i).astype(np.complex64)))
    strat = hnp.arrays(np_dtype(name), shape, elements=elements(name, lo, hi))
    return strat.map(bf16_round) if name == "bfloat16" else strat


def to_mx(x: np.ndarray, name: str) -> mx.Array:
    """An MLX array of dtype `name` with the values of `x` (bfloat16 through astype)."""
    if name == "bfloat16":
        return mx.astype(mx.array(x, mx.float32), mx.bfloat16)
    return mx.array(x, getattr(mx, "bool_" if name == "bool" else name))


def to_np(a: mx.Array) -> np.ndarray:
    return np.asarray(a)
