"""The Array's own conversions (array.py calls mlx-c for them itself, below `ops`): a dtype given to
`array`, host copies of strided views and of half types, and a freed array."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pymlxc.core as mx
from pymlxc.core import FreedArrayError

FLOATS = hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=5),
                    elements=st.floats(-1e3, 1e3, width=32))


@settings(max_examples=40, deadline=None)
@given(x=FLOATS, dtype=st.sampled_from(["float16", "bfloat16", "int32", "float32"]))
def test_array_with_a_dtype_converts_as_astype(x: np.ndarray, dtype: str) -> None:
    want = np.array(mx.astype(mx.array(x), getattr(mx, dtype)))
    got = mx.array(mx.array(x), dtype=getattr(mx, dtype))
    assert got.dtype == getattr(mx, dtype)
    np.testing.assert_array_equal(np.array(got), want)
    np.testing.assert_array_equal(np.array(mx.array(x, dtype=getattr(mx, dtype))), want)


@settings(max_examples=40, deadline=None)
@given(x=FLOATS, dtype=st.sampled_from(["float16", "bfloat16", "float32"]))
def test_host_copies_of_views_and_half_types(x: np.ndarray, dtype: str) -> None:
    a = mx.array(x).astype(getattr(mx, dtype))
    ref = np.array(a).astype(np.float32)
    np.testing.assert_array_equal(np.array(mx.transpose(a)).astype(np.float32), ref.T)
    wide = mx.broadcast_to(mx.expand_dims(a, 0), (3, *x.shape))  # a strided view even once evaluated
    np.testing.assert_array_equal(np.array(wide).astype(np.float32), np.broadcast_to(ref, (3, *x.shape)))


def test_a_freed_array_is_refused_by_the_conversions() -> None:
    a = mx.array([1.0, 2.0])
    a.free()
    with pytest.raises(FreedArrayError):
        mx.array(a, dtype=mx.int32)
    with pytest.raises(FreedArrayError):
        np.array(a)
