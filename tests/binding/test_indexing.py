"""Indexing and slice assignment against numpy: ints, slices with any step, None, Ellipsis, integer
arrays (numpy's placement rules for the index dimensions) and their mixes."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pymlxc.core as mx

from .strategies import FAST, to_np

array_shapes = hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=5)


def slices(n: int) -> st.SearchStrategy[slice]:
    bound = st.none() | st.integers(-n - 2, n + 2)
    step = st.none() | st.sampled_from([1, 2, 3, -1, -2, -3])
    return st.builds(slice, bound, bound, step)


@st.composite
def indices(draw: st.DrawFn, shape: tuple[int, ...], arrays: bool) -> tuple[Any, ...]:
    """An index for `shape`: per axis an int, a slice or (if `arrays`) an integer array; Nones
    anywhere; sometimes an Ellipsis standing for some axes."""
    items: list[Any] = []
    ndim = len(shape)
    covered = draw(st.integers(0, ndim))  # index only the first `covered` axes (the rest are implicit)
    ellipsis_at = draw(st.none() | st.integers(0, covered)) if covered < ndim else None
    axis = 0
    while axis < covered:
        if ellipsis_at == len(items) and not any(i is Ellipsis for i in items):
            items.append(Ellipsis)
            axis += ndim - covered  # the Ellipsis covers the axes not indexed explicitly
            covered = ndim
            continue
        n = shape[axis]
        kinds = ["int", "slice"] + (["array"] if arrays else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "int":
            items.append(draw(st.integers(-n, n - 1)))
        elif kind == "slice":
            items.append(draw(slices(n)))
        else:
            ishape = draw(hnp.array_shapes(min_dims=0, max_dims=2, max_side=3))
            items.append(draw(hnp.arrays(np.int32, ishape, elements=st.integers(-n, n - 1))))
        axis += 1
        if draw(st.integers(0, 5)) == 0:
            items.append(None)
    if draw(st.booleans()):
        items.insert(draw(st.integers(0, len(items))), None)
    return tuple(items)


def as_mx_index(index: tuple[Any, ...], how: str) -> Any:
    """numpy index arrays as MLX arrays, lists or numpy arrays."""
    def conv(i: Any) -> Any:
        if isinstance(i, np.ndarray):
            return mx.array(i) if how == "mx" else i.tolist() if how == "list" and i.ndim else i
        return i
    out = tuple(conv(i) for i in index)
    return out[0] if len(out) == 1 and how == "bare" else out


@FAST
@given(data=st.data())
def test_basic_indexing_matches_numpy(data: st.DataObject) -> None:
    shape = data.draw(array_shapes)
    x = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    index = data.draw(indices(shape, arrays=False))
    ref = x[index]
    out = to_np(mx.array(x)[index])
    assert out.shape == ref.shape
    np.testing.assert_array_equal(out, ref)


@FAST
@given(data=st.data())
def test_single_int_and_slice_fast_paths(data: st.DataObject) -> None:
    shape = data.draw(array_shapes)
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    a = mx.array(x)
    i = data.draw(st.integers(-shape[0], shape[0] - 1))
    s = data.draw(slices(shape[0]))
    np.testing.assert_array_equal(to_np(a[i]), x[i])
    np.testing.assert_array_equal(to_np(a[s]), x[s])
    assert a[s].shape == x[s].shape


@FAST
@given(data=st.data())
def test_integer_array_indexing_matches_numpy(data: st.DataObject) -> None:
    shape = data.draw(array_shapes)
    x = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    index = data.draw(indices(shape, arrays=True))
    assume(any(isinstance(i, np.ndarray) for i in index))
    how = data.draw(st.sampled_from(["mx", "list", "numpy"]))
    try:
        ref = x[index]
    except IndexError:  # index arrays that do not broadcast together: MLX refuses them too
        with pytest.raises((IndexError, mx.MLXError)):
            mx.array(x)[as_mx_index(index, how)]
        return
    out = to_np(mx.array(x)[as_mx_index(index, how)])
    assert out.shape == ref.shape, (index, how)
    np.testing.assert_array_equal(out, ref)


@FAST
@given(data=st.data())
def test_slice_assignment_matches_numpy(data: st.DataObject) -> None:
    shape = data.draw(array_shapes)
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    index = data.draw(indices(shape, arrays=False))
    target = x[index].shape
    # The value: a scalar, an array of the selected shape, or one that broadcasts to it.
    kind = data.draw(st.sampled_from(["scalar", "full", "broadcast", "leading ones"]))
    if kind == "scalar":
        value: Any = -7.5
    elif kind == "broadcast" and target:
        value = -np.arange(target[-1], dtype=np.float32) - 1
    elif kind == "full" or not target:
        value = -np.arange(int(np.prod(target)), dtype=np.float32).reshape(target) - 1
    else:
        value = np.full((1, 1, *target), -3.0, np.float32)
    y = x.copy()
    y[index] = value
    a = mx.array(x)
    a[index] = mx.array(value) if data.draw(st.booleans()) else value
    np.testing.assert_array_equal(to_np(a), y)


@FAST
@given(data=st.data())
def test_integer_array_assignment_matches_numpy(data: st.DataObject) -> None:
    shape = data.draw(array_shapes)
    x = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    index = data.draw(indices(shape, arrays=True))
    assume(any(isinstance(i, np.ndarray) for i in index))
    try:
        positions = np.arange(x.size).reshape(shape)[index]
    except IndexError:
        assume(False)
    assume(len(np.unique(positions)) == positions.size)  # repeated targets: the winner is unspecified
    value = -np.arange(positions.size, dtype=np.int32).reshape(positions.shape) - 1
    y = x.copy()
    y[index] = value
    a = mx.array(x)
    a[as_mx_index(index, "mx")] = mx.array(value)
    np.testing.assert_array_equal(to_np(a), y)


def test_assignment_casts_to_the_array_dtype_and_keeps_other_references() -> None:
    a = mx.array([1, 2, 3], mx.int8)
    b = a
    a[1] = 9.7
    assert a.dtype is mx.int8 and a.tolist() == [1, 9, 3] and b.tolist() == [1, 9, 3]
    c = mx.array([[1.0, 2.0], [3.0, 4.0]], mx.bfloat16)
    c[:, 0] = mx.array([5, 6])
    assert c.dtype is mx.bfloat16 and c.tolist() == [[5.0, 2.0], [6.0, 4.0]]


def test_index_errors() -> None:
    a = mx.zeros((2, 3))
    with pytest.raises(IndexError):
        a[2]
    with pytest.raises(IndexError):
        a[0, 0, 0]
    with pytest.raises(IndexError):
        a[..., ...]
    with pytest.raises(IndexError):
        a[mx.array([True, False])]
    with pytest.raises(IndexError):
        a[mx.array([0.5])]
    with pytest.raises(IndexError):
        a["x"]
    with pytest.raises(IndexError):
        mx.array(1.0)[0]
    assert a[np.int64(1)].shape == (3,) and a[mx.array(1)].shape == (3,)
