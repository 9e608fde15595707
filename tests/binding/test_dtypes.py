"""Creation and round trip of every dtype, views included, and the Array's metadata."""
from __future__ import annotations

import importlib
import math

import mlx.core as mlx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pymlxc.core as mx

from .strategies import ALL_NAMES, FAST, FEWER, bf16_round, np_arrays, np_dtype, shapes, to_mx, to_np


def mx_dtype(name: str) -> mx.Dtype:
    return mx.bool_ if name == "bool" else getattr(mx, name)


def mlx_dtype(name: str) -> mlx.Dtype:
    return getattr(mlx, "bool_" if name == "bool" else name)


@pytest.mark.parametrize("name", ALL_NAMES)
@FEWER
@given(data=st.data())
def test_round_trip_of_every_dtype(name: str, data: st.DataObject) -> None:
    x = data.draw(np_arrays(name))
    with mx.stream_scope(mx.cpu):  # float64 runs on the CPU only
        a = to_mx(x, name)
        assert a.dtype is mx_dtype(name)
        assert a.shape == x.shape and a.ndim == x.ndim and a.size == x.size
        assert a.nbytes == x.size * mx_dtype(name).size
        out = to_np(a)
    assert out.dtype == np_dtype(name)
    np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("name", ALL_NAMES)
@FEWER
@given(data=st.data())
def test_views_read_back_with_their_values(name: str, data: st.DataObject) -> None:
    """Transposes, strided and reversed slices and broadcasts are strided in MLX: to_numpy must still
    give the values in row-major order."""
    x = data.draw(np_arrays(name, shape=st.tuples(st.integers(1, 5), st.integers(1, 5), st.integers(1, 4))))
    step = data.draw(st.sampled_from([1, 2, -1, -2]))
    with mx.stream_scope(mx.cpu):
        a = to_mx(x, name)
        views = {
            "transpose": (mx.transpose(a, (2, 0, 1)), x.transpose(2, 0, 1)),
            "T": (a.T, x.T),
            "slice": (a[::step, 1:, ::-1], x[::step, 1:, ::-1]),
            "broadcast": (mx.broadcast_to(a[:, :1], (x.shape[0], 3, x.shape[2])),
                          np.broadcast_to(x[:, :1], (x.shape[0], 3, x.shape[2]))),
            "broadcast+transpose": (mx.broadcast_to(a[:1], (3, *x.shape[1:])).T,
                                    np.broadcast_to(x[:1], (3, *x.shape[1:])).T),
            "swapaxes of slice": (mx.swapaxes(a[..., ::2], 0, 1), np.swapaxes(x[..., ::2], 0, 1)),
        }
        for label, (view, ref) in views.items():
            out = to_np(view)
            assert out.shape == ref.shape, label
            np.testing.assert_array_equal(out, ref, err_msg=label)


def test_float64_from_numpy_narrows_like_mlx_unless_asked() -> None:
    x = np.array([1.5, -2.25])
    assert mx.array(x).dtype is mx.float32 and mlx.array(x).dtype == mlx.float32
    assert mx.array(np.float64(1.5)).dtype is mx.float32
    assert mx.array(x, mx.float64).dtype is mx.float64
    assert mx.array(x.astype(np.complex128)).dtype is mx.complex64


def test_bfloat16_reads_back_as_float32_values() -> None:
    values = np.array([1.5, -2.25, 3.0e38, 1e-3, 0.0], np.float32)
    a = mx.astype(mx.array(values), mx.bfloat16)
    out = to_np(a)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, bf16_round(values))
    np.testing.assert_array_equal(out, np.asarray(mlx.array(values).astype(mlx.bfloat16).astype(mlx.float32)))
    assert a.item() if a.size == 1 else True
    assert mx.array(2.75, mx.bfloat16).item() == 2.75
    assert mx.array([1.0, 2.0], "bfloat16").dtype is mx.bfloat16


def test_bfloat16_from_numpy_through_ml_dtypes() -> None:
    ml_dtypes = importlib.import_module("ml_dtypes")
    x = np.array([1.5, -2.0, 0.25], dtype=ml_dtypes.bfloat16)
    a = mx.array(x)
    assert a.dtype is mx.bfloat16
    np.testing.assert_array_equal(to_np(a), x.astype(np.float32))


@pytest.mark.parametrize("name", ALL_NAMES)
def test_scalar_creation_item_and_tolist_match_mlx(name: str) -> None:
    value = {"bool": True, "float16": 1.5, "bfloat16": -2.5, "float32": 0.1, "float64": 0.1,
             "complex64": 1 + 2j}.get(name, 7)
    with mx.stream_scope(mx.cpu):
        a = mx.array(value, mx_dtype(name))
        ref = mlx.array(value, mlx_dtype(name))
        assert a.shape == () and a.ndim == 0 and a.size == 1
        assert a.item() == ref.item() and type(a.item()) is type(ref.item())
        assert a.tolist() == ref.tolist()
        b = mx.array([value, value], mx_dtype(name))
        assert b.tolist() == mlx.array([value, value], mlx_dtype(name)).tolist()
        assert [type(v) for v in b.tolist()] == [type(v) for v in mlx.array([value, value], mlx_dtype(name)).tolist()]


@FAST
@given(x=np_arrays("float32", shape=shapes, lo=-1000, hi=1000))
def test_repr_and_metadata_match_mlx(x: np.ndarray) -> None:
    a, ref = mx.array(x), mlx.array(x)
    assert repr(a) == repr(ref)
    assert (a.shape, a.ndim, a.size, a.nbytes, a.itemsize) == (ref.shape, ref.ndim, ref.size, ref.nbytes, ref.itemsize)
    assert a.tolist() == ref.tolist()
    if x.size == 1:
        assert a.item() == ref.item()
    if x.ndim:
        assert len(a) == len(ref)


def test_python_scalar_and_list_defaults_match_mlx() -> None:
    cases = [1.5, 3, True, 2j, 2**40, -(2**40), [1, 2], [1, 2.0], [True, False], [True, 2], [2**31, 1], [],
             [[1, 2], [3, 4]], (1.0, 2.0), [1 + 1j, 2]]
    for value in cases:
        assert mx.array(value).dtype.name == str(mlx.array(value).dtype).split(".")[-1], value
        assert mx.array(value).tolist() == mlx.array(value).tolist(), value
    assert mx.array(np.int64(5)).dtype is mx.int64
    assert mx.array(np.float16(5)).dtype is mx.float16


def test_out_of_range_scalars_raise() -> None:
    with pytest.raises(ValueError, match="overflow"):
        mx.array(300, mx.int8)
    with pytest.raises(ValueError, match="overflow"):
        mx.array(-1, mx.uint32)
    with pytest.raises(ValueError):
        mx.array(2**70)
    with pytest.raises(ValueError):
        mx.array([[1, 2], [3]])


def test_array_of_an_array_is_a_new_array() -> None:
    a = mx.array([1, 2, 3])
    b = mx.array(a)
    c = mx.Array(a)
    b[0] = 10
    c[1] = 20
    assert a.tolist() == [1, 2, 3] and b.tolist() == [10, 2, 3] and c.tolist() == [1, 20, 3]
    d = a[...]
    d[2] = 30
    assert a.tolist() == [1, 2, 3]


def test_conversions() -> None:
    assert int(mx.array(2.7, mx.bfloat16)) == 2
    assert float(mx.array(3)) == 3.0
    assert bool(mx.array([0])) is False
    assert [v.tolist() for v in mx.array([[1, 2], [3, 4]])] == [[1, 2], [3, 4]]
    assert list(range(10))[mx.array(3)] == 3
    with pytest.raises(TypeError):
        len(mx.array(1))
    with pytest.raises(ValueError):
        mx.array([1, 2]).item()
    with pytest.raises(TypeError):
        list(range(3))[mx.array(1.0)]
    assert np.asarray(mx.array([1, 2]), dtype=np.float64).dtype == np.float64
    assert math.isnan(mx.array(float("nan")).item())
    big = np.arange(4, dtype=">f4")  # byte order is converted
    np.testing.assert_array_equal(to_np(mx.array(big)), big.astype(np.float32))
