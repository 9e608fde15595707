"""Ops against numpy over random shapes, dtypes and broadcasting; result dtypes against mlx.core."""
from __future__ import annotations

import math

import mlx.core as mlx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pymlxc.core as mx

from .strategies import FAST, FEWER, FLOAT_DTYPES, INT_DTYPES, np_arrays, np_dtype, to_mx, to_np

TOL = {"float32": (2e-5, 2e-5), "float16": (2e-3, 2e-3), "bfloat16": (1e-2, 1e-2)}


def same_dtype(ours: mx.Array, theirs: mlx.array) -> bool:
    return ours.dtype.name == str(theirs.dtype).split(".")[-1]


def mlx_np(x: mlx.array) -> np.ndarray:
    """mlx.core's values in numpy (its own export refuses bfloat16)."""
    return np.asarray(x.astype(mlx.float32) if x.dtype == mlx.bfloat16 else x)


def close(ours: mx.Array, ref: np.ndarray, name: str = "float32", scale: float = 1.0) -> None:
    rtol, atol = TOL.get(name, (0, 0))
    out = to_np(ours)
    assert out.shape == np.shape(ref)
    np.testing.assert_allclose(out.astype(np.float64), np.asarray(ref, np.float64), rtol=rtol * scale,
                               atol=atol * scale)


# ---------------------------------------------------------------------- elementwise unary

def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


UNARY = {
    # name: (numpy reference, input range, extra tolerance factor)
    "abs": (np.abs, (-50, 50), 1), "negative": (np.negative, (-50, 50), 1), "sign": (np.sign, (-50, 50), 1),
    "square": (np.square, (-50, 50), 1), "exp": (np.exp, (-10, 10), 1), "log": (np.log, (0.01, 100), 1),
    "log1p": (np.log1p, (0, 100), 1), "log2": (np.log2, (0.01, 100), 1), "log10": (np.log10, (0.01, 100), 1),
    "sqrt": (np.sqrt, (0, 100), 1), "rsqrt": (lambda x: 1 / np.sqrt(x), (0.01, 100), 2),
    "reciprocal": (np.reciprocal, (0.1, 100), 1), "sin": (np.sin, (-10, 10), 5), "cos": (np.cos, (-10, 10), 5),
    "tan": (np.tan, (-1.2, 1.2), 5), "tanh": (np.tanh, (-10, 10), 2), "sinh": (np.sinh, (-5, 5), 2),
    "cosh": (np.cosh, (-5, 5), 2), "arctan": (np.arctan, (-10, 10), 1), "arcsin": (np.arcsin, (-1, 1), 2),
    "arccos": (np.arccos, (-1, 1), 2), "expm1": (np.expm1, (-5, 5), 2), "floor": (np.floor, (-50, 50), 1),
    "ceil": (np.ceil, (-50, 50), 1), "sigmoid": (_sigmoid, (-20, 20), 2),
    "erf": (np.vectorize(math.erf, otypes=[np.float64]), (-3, 3), 5),
}


@pytest.mark.parametrize("op", sorted(UNARY))
@FEWER
@given(data=st.data())
def test_unary_float_ops(op: str, data: st.DataObject) -> None:
    ref_fn, (lo, hi), scale = UNARY[op]
    name = data.draw(st.sampled_from(FLOAT_DTYPES))
    x = data.draw(np_arrays(name, lo=lo, hi=hi))
    a = to_mx(x, name)
    out = getattr(mx, op)(a)
    assert out.dtype.name == name
    assert same_dtype(out, getattr(mlx, op)(mlx.array(x).astype(getattr(mlx, name))))
    ref = ref_fn(x.astype(np.float64))
    if name != "float32":  # the result is rounded to the dtype; compare in its precision
        ref = ref_fn(to_np(a).astype(np.float64))
    close(out, ref, name, scale=scale * (10 if name != "float32" else 1))


@pytest.mark.parametrize("name", INT_DTYPES)
@FEWER
@given(data=st.data())
def test_unary_int_ops(name: str, data: st.DataObject) -> None:
    x = data.draw(np_arrays(name, lo=-100, hi=100))
    a = to_mx(x, name)
    np.testing.assert_array_equal(to_np(mx.abs(a)), np.abs(x))
    np.testing.assert_array_equal(to_np(mx.square(a)), np.square(x))
    np.testing.assert_array_equal(to_np(~a), ~x)
    if name.startswith("int"):
        np.testing.assert_array_equal(to_np(-a), -x)
    assert (-a).dtype.name == name if name.startswith("int") else True


# ---------------------------------------------------------------------- elementwise binary

BINARY_FLOAT = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": np.divide,
    "maximum": np.maximum, "minimum": np.minimum, "arctan2": np.arctan2, "logaddexp": np.logaddexp,
    "power": None, "equal": np.equal, "not_equal": np.not_equal, "less": np.less, "less_equal": np.less_equal,
    "greater": np.greater, "greater_equal": np.greater_equal,
}

pairs_of_shapes = hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=4, max_side=4)


@pytest.mark.parametrize("op", sorted(BINARY_FLOAT))
@FEWER
@given(data=st.data(), shapes2=pairs_of_shapes)
def test_binary_float_ops_broadcast(op: str, data: st.DataObject, shapes2: hnp.BroadcastableShapes) -> None:
    name = data.draw(st.sampled_from(FLOAT_DTYPES))
    sa, sb = shapes2.input_shapes
    lo = 0.1 if op in ("divide", "power") else -20
    x = data.draw(np_arrays(name, shape=sa, lo=lo, hi=20))
    y = data.draw(np_arrays(name, shape=sb, lo=lo if op != "power" else -2, hi=20 if op != "power" else 2))
    a, b = to_mx(x, name), to_mx(y, name)
    out = getattr(mx, op)(a, b)
    assert out.shape == shapes2.result_shape
    dtype = getattr(mlx, name)
    assert same_dtype(out, getattr(mlx, op)(mlx.array(x).astype(dtype), mlx.array(y).astype(dtype)))
    xs, ys = to_np(a).astype(np.float64), to_np(b).astype(np.float64)
    ref = np.power(xs, ys) if op == "power" else BINARY_FLOAT[op](xs, ys)
    if ref.dtype == bool:
        # Comparisons are exact, but rounding both inputs to the dtype happened already.
        np.testing.assert_array_equal(to_np(out), ref)
    else:
        close(out, ref, name, scale=10 if name != "float32" else 4)


BINARY_INT = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "floor_divide": np.floor_divide,
    "remainder": np.remainder, "maximum": np.maximum, "minimum": np.minimum, "bitwise_and": np.bitwise_and,
    "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor, "equal": np.equal, "less": np.less,
}


@pytest.mark.parametrize("op", sorted(BINARY_INT))
@FEWER
@given(data=st.data(), shapes2=pairs_of_shapes)
def test_binary_int_ops_broadcast(op: str, data: st.DataObject, shapes2: hnp.BroadcastableShapes) -> None:
    name = data.draw(st.sampled_from(INT_DTYPES))
    sa, sb = shapes2.input_shapes
    x = data.draw(np_arrays(name, shape=sa, lo=-10, hi=10))
    y = data.draw(np_arrays(name, shape=sb, lo=1 if op in ("floor_divide", "remainder") else -10, hi=10))
    out = getattr(mx, op)(to_mx(x, name), to_mx(y, name))
    ref = BINARY_INT[op](x, y)
    assert out.dtype.name == (name if ref.dtype != bool else "bool")
    np.testing.assert_array_equal(to_np(out), ref)


@FAST
@given(data=st.data())
def test_mixed_dtype_promotion_matches_mlx(data: st.DataObject) -> None:
    names = ["bool", *INT_DTYPES, "float16", "bfloat16", "float32", "complex64"]
    na, nb = data.draw(st.sampled_from(names)), data.draw(st.sampled_from(names))
    x = data.draw(np_arrays(na, shape=st.just((3,)), lo=0, hi=5))
    y = data.draw(np_arrays(nb, shape=st.just((2, 1)), lo=0, hi=5))
    ours = to_mx(x, na) + to_mx(y, nb)
    theirs = mlx.array(np.asarray(x).astype(np_dtype(na))).astype(getattr(mlx, na if na != "bool" else "bool_")) + \
        mlx.array(np.asarray(y).astype(np_dtype(nb))).astype(getattr(mlx, nb if nb != "bool" else "bool_"))
    assert same_dtype(ours, theirs)
    np.testing.assert_allclose(to_np(ours).astype(np.complex128), mlx_np(theirs).astype(np.complex128), rtol=1e-2)


SCALARS = [True, 3, -2, 1.5, 2j]


@pytest.mark.parametrize("name", ["bool", *INT_DTYPES, "float16", "bfloat16", "float32", "complex64"])
def test_python_scalars_are_weakly_typed_like_mlx(name: str) -> None:
    """float32 array + 1.5 stays float32, int8 array + 3 stays int8, bool array + 3 is int32..."""
    x = np.array([1, 0, 1]).astype(np_dtype(name))
    a = to_mx(x, name)
    ref = mlx.array(x).astype(getattr(mlx, name if name != "bool" else "bool_"))
    for s in SCALARS:
        if name.startswith("uint") and isinstance(s, int) and s < 0:
            continue
        for ours, theirs in [(a + s, ref + s), (s + a, s + ref), (a * s, ref * s), (s - a, s - ref)]:
            assert same_dtype(ours, theirs), (name, s)
            np.testing.assert_allclose(to_np(ours).astype(np.complex128), mlx_np(theirs).astype(np.complex128))
        assert same_dtype(a < s, ref < s)
    # numpy scalars and arrays take the array's dtype, as in mlx.core (np.float64 is a Python float)
    for np_value in [np.float32(2), np.float64(2), np.int64(1), np.bool_(True), np.array([2.0, 1.0, 1.0])]:
        assert same_dtype(a + np_value, ref + np_value), (name, np_value)
    for fn in ["add", "maximum", "minimum", "multiply", "subtract"]:  # functions are weakly typed too
        for s in [2, 1.5]:
            assert same_dtype(getattr(mx, fn)(a, s), getattr(mlx, fn)(ref, s)), (fn, name, s)
            assert same_dtype(getattr(mx, fn)(s, a), getattr(mlx, fn)(s, ref)), (fn, name, s)
    assert same_dtype(mx.where(a > 0, a, 2), mlx.where(ref > 0, ref, 2))
    if name in ("int8", "uint8"):
        with pytest.raises(ValueError, match="overflow"):
            a + 1000


def test_scalar_operand_edge_values() -> None:
    h = mx.array([1.0, 2.0], mx.float16)
    assert (h + 1e6).tolist() == [math.inf, math.inf]  # like mlx.core: rounds to inf in float16
    b = mx.array([1.0], mx.bfloat16)
    assert (b * 3.0e38).dtype is mx.bfloat16
    assert math.isnan((b * float("nan")).item())
    big = mx.array([1], mx.int64) + 2**40
    assert big.dtype is mx.int64 and big.item() == 2**40 + 1
    with pytest.raises(ValueError, match="overflow"):
        mx.array([1], mx.int32) + 2**40
    assert (mx.array([1.5]) == None) is False  # noqa: E711  (NotImplemented falls back to identity)
    with pytest.raises(TypeError):
        mx.array([1.0]) + "a"


@FEWER
@given(data=st.data())
def test_operators_match_functions(data: st.DataObject) -> None:
    x = data.draw(np_arrays("float32", shape=st.just((2, 3)), lo=0.5, hi=4))
    y = data.draw(np_arrays("float32", shape=st.just((3,)), lo=0.5, hi=4))
    a, b = mx.array(x), mx.array(y)
    for ours, ref in [(a + b, x + y), (a - b, x - y), (a * b, x * y), (a / b, x / y), (a ** b, x ** y),
                      (a // b, x // y), (a % b, np.mod(x, y)), (y - a, y - x), (2.0 / a, 2.0 / x), (-a, -x),
                      (abs(-a), x),
                      (a @ mx.array(y[:, None] * np.ones((3, 2), np.float32)), x @ (y[:, None] * np.ones((3, 2))))]:
        np.testing.assert_allclose(to_np(ours), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(to_np(a > b), x > y)
    np.testing.assert_array_equal(to_np((a > 1) & (b < 2)), (x > 1) & (y < 2))
    np.testing.assert_array_equal(to_np((a > 1) | (b < 2)), (x > 1) | (y < 2))
    np.testing.assert_array_equal(to_np(~(a > 1)), ~(x > 1))
    np.testing.assert_allclose(to_np(x + a), x + x)  # numpy on the left defers to Array
    i = mx.array([5, 12])
    assert (i & 6).tolist() == [4, 4] and (i | 1).tolist() == [5, 13] and (i ^ 3).tolist() == [6, 15]
    assert (i << 1).tolist() == [10, 24] and (i >> 2).tolist() == [1, 3] and (1 << mx.array([2])).tolist() == [4]


# ---------------------------------------------------------------------- reductions

def axes_for(ndim: int) -> st.SearchStrategy:
    if ndim == 0:
        return st.just(None)
    one = st.integers(-ndim, ndim - 1)
    many = st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True).map(tuple)
    return st.one_of(st.none(), one, many)


REDUCTIONS = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod, "all": np.all,
              "any": np.any, "var": np.var, "std": np.std, "logsumexp": None}


@pytest.mark.parametrize("op", sorted(REDUCTIONS))
@FEWER
@given(data=st.data())
def test_reductions_with_axis_and_keepdims(op: str, data: st.DataObject) -> None:
    shape = data.draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=1, max_side=4))
    # A product of up to 256 values of 3 leaves float32's range (81 threes did: inf against the
    # float64 reference's 4.4e38): prod's values stay within 1.25 (1.25^256 is 6.5e24).
    bound = 1.25 if op == "prod" else 3
    x = data.draw(np_arrays("float32", shape=shape, lo=-bound, hi=bound))
    axis = data.draw(axes_for(x.ndim))
    keepdims = data.draw(st.booleans())
    out = getattr(mx, op)(mx.array(x), axis=axis, keepdims=keepdims)
    theirs = getattr(mlx, op)(mlx.array(x), axis=axis, keepdims=keepdims)
    assert same_dtype(out, theirs) and out.shape == theirs.shape
    xs = x.astype(np.float64)
    if op == "logsumexp":
        m = np.max(xs, axis=axis, keepdims=True)
        ref = np.log(np.sum(np.exp(xs - m), axis=axis, keepdims=True)) + m
        ref = ref if keepdims else np.squeeze(ref, axis=axis) if axis is not None else ref.reshape(())
    else:
        ref = REDUCTIONS[op](xs, axis=axis, keepdims=keepdims)
    if op in ("all", "any"):
        np.testing.assert_array_equal(to_np(out), ref)
    else:
        close(out, ref, scale=20)


@FAST
@given(data=st.data())
def test_arg_reductions_and_int_reductions(data: st.DataObject) -> None:
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=5))
    x = data.draw(hnp.arrays(np.int32, shape, elements=st.integers(-1000, 1000), unique=True))
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1))
    keepdims = data.draw(st.booleans())
    a = mx.array(x)
    np.testing.assert_array_equal(to_np(mx.argmax(a, axis=axis, keepdims=keepdims)),
                                  np.argmax(x, axis=axis, keepdims=keepdims))
    np.testing.assert_array_equal(to_np(mx.argmin(a, axis=axis, keepdims=keepdims)),
                                  np.argmin(x, axis=axis, keepdims=keepdims))
    assert mx.argmax(a).item() == int(np.argmax(x))
    s = mx.sum(a, axis=axis)
    assert same_dtype(s, mlx.sum(mlx.array(x), axis=axis))
    np.testing.assert_array_equal(to_np(s), np.sum(x, axis=axis))
    np.testing.assert_array_equal(to_np(mx.cumsum(a, axis=axis)), np.cumsum(x, axis=axis))
    np.testing.assert_array_equal(to_np(mx.sort(a, axis=axis)), np.sort(x, axis=axis))
    np.testing.assert_array_equal(to_np(mx.argsort(a, axis=axis)), np.argsort(x, axis=axis))


# ---------------------------------------------------------------------- matmul

@FAST
@given(data=st.data())
def test_matmul_with_batch_broadcasting(data: st.DataObject) -> None:
    n, k, m = (data.draw(st.integers(1, 6)) for _ in range(3))
    batch = data.draw(hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=2, max_side=3))
    sa, sb = batch.input_shapes
    name = data.draw(st.sampled_from(FLOAT_DTYPES))
    x = data.draw(np_arrays(name, shape=st.just((*sa, n, k)), lo=-2, hi=2))
    y = data.draw(np_arrays(name, shape=st.just((*sb, k, m)), lo=-2, hi=2))
    a, b = to_mx(x, name), to_mx(y, name)
    out = mx.matmul(a, b)
    assert out.shape == (*batch.result_shape, n, m) and out.dtype.name == name
    ref = np.matmul(to_np(a).astype(np.float64), to_np(b).astype(np.float64))
    close(out, ref, name, scale=50 * k)
    # vectors: (k,) @ (k, m) and (n, k) @ (k,)
    v = mx.array(np.ones(k, np.float32))
    assert (v @ mx.ones((k, m))).shape == (m,) and (mx.ones((n, k)) @ v).shape == (n,)


# ---------------------------------------------------------------------- shapes

@FAST
@given(data=st.data())
def test_transpose_reshape_and_friends(data: st.DataObject) -> None:
    x = data.draw(np_arrays("int32", shape=hnp.array_shapes(min_dims=1, max_dims=4, max_side=4)))
    a = mx.array(x)
    perm = data.draw(st.permutations(range(x.ndim)))
    np.testing.assert_array_equal(to_np(mx.transpose(a, perm)), np.transpose(x, perm))
    np.testing.assert_array_equal(to_np(mx.transpose(a)), np.transpose(x))
    np.testing.assert_array_equal(to_np(a.T), x.T)
    new_shape = data.draw(st.sampled_from([(-1,), (x.size,), (1, -1), x.shape[::-1] if x.size else (0,)]))
    np.testing.assert_array_equal(to_np(mx.reshape(a, new_shape)), np.reshape(x, new_shape))
    np.testing.assert_array_equal(to_np(a.reshape(*new_shape)), np.reshape(x, new_shape))
    np.testing.assert_array_equal(to_np(mx.flatten(a)), x.reshape(-1))
    ax = data.draw(st.integers(-x.ndim - 1, x.ndim))
    np.testing.assert_array_equal(to_np(mx.expand_dims(a, ax)), np.expand_dims(x, ax))
    np.testing.assert_array_equal(to_np(mx.squeeze(mx.expand_dims(a, 0), 0)), x)
    s0, s1 = data.draw(st.integers(0, x.ndim - 1)), data.draw(st.integers(0, x.ndim - 1))
    np.testing.assert_array_equal(to_np(mx.swapaxes(a, s0, s1)), np.swapaxes(x, s0, s1))
    np.testing.assert_array_equal(to_np(mx.moveaxis(a, s0, s1)), np.moveaxis(x, s0, s1))


@FAST
@given(data=st.data())
def test_concatenate_stack_split(data: st.DataObject) -> None:
    base = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    axis = data.draw(st.integers(-len(base), len(base) - 1))
    count = data.draw(st.integers(1, 4))
    parts = []
    for _ in range(count):
        shape = list(base)
        shape[axis] = data.draw(st.integers(0, 3))
        parts.append(data.draw(np_arrays("float32", shape=st.just(tuple(shape)))))
    arrays = [mx.array(p) for p in parts]
    cat = mx.concatenate(arrays, axis=axis)
    np.testing.assert_array_equal(to_np(cat), np.concatenate(parts, axis=axis))
    np.testing.assert_array_equal(to_np(mx.concatenate(arrays, axis=None)), np.concatenate([p.ravel() for p in parts]))
    same = [data.draw(np_arrays("float32", shape=st.just(base))) for _ in range(count)]
    stack_axis = data.draw(st.integers(-len(base) - 1, len(base)))
    np.testing.assert_array_equal(to_np(mx.stack([mx.array(s) for s in same], axis=stack_axis)),
                                  np.stack(same, axis=stack_axis))
    whole = np.concatenate(parts, axis=axis)
    n = whole.shape[axis]
    sections = data.draw(st.sampled_from([d for d in range(1, 5) if n % d == 0] or [1]))
    ours = mx.split(mx.array(whole), sections, axis=axis)
    ref = np.split(whole, sections, axis=axis)
    assert len(ours) == len(ref)
    for o, r in zip(ours, ref, strict=True):
        np.testing.assert_array_equal(to_np(o), r)
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=3)))
    for o, r in zip(mx.split(mx.array(whole), cuts, axis=axis), np.split(whole, cuts, axis=axis), strict=True):
        np.testing.assert_array_equal(to_np(o), r)


@FEWER
@given(data=st.data())
def test_where_clip_take_and_creation(data: st.DataObject) -> None:
    x = data.draw(np_arrays("float32", shape=hnp.array_shapes(min_dims=1, max_dims=3, max_side=4)))
    a = mx.array(x)
    np.testing.assert_array_equal(to_np(mx.where(a > 0, a, 0.0)), np.where(x > 0, x, 0.0))
    assert mx.where(mx.array([True]), mx.array([1], mx.int8), 3).dtype is mx.int8
    np.testing.assert_array_equal(to_np(mx.clip(a, -1.0, 1.0)), np.clip(x, -1, 1))
    if x.shape[0]:
        idx = data.draw(hnp.arrays(np.int32, (3,), elements=st.integers(0, x.shape[0] - 1)))
        np.testing.assert_array_equal(to_np(mx.take(a, mx.array(idx), axis=0)), np.take(x, idx, axis=0))
    np.testing.assert_array_equal(to_np(mx.zeros((2, 3), mx.int8)), np.zeros((2, 3), np.int8))
    np.testing.assert_array_equal(to_np(mx.full((2,), 7)), [7, 7])
    np.testing.assert_array_equal(to_np(mx.arange(5)), np.arange(5))
    np.testing.assert_allclose(to_np(mx.arange(0.0, 1.0, 0.25)), np.arange(0, 1, 0.25))
    np.testing.assert_allclose(to_np(mx.linspace(0, 1, 5)), np.linspace(0, 1, 5), rtol=1e-6)
    np.testing.assert_array_equal(to_np(mx.eye(3, 4, 1)), np.eye(3, 4, 1))
    np.testing.assert_array_equal(to_np(mx.tril(mx.ones((3, 3)))), np.tril(np.ones((3, 3))))


# ---------------------------------------------------------------------- quantization

@FEWER
@given(data=st.data())
def test_quantize_round_trip_error_bound(data: st.DataObject) -> None:
    """Affine quantization keeps each element within half a step of its group's grid. MLX snaps the
    larger-magnitude edge of a group onto the grid exactly (so zero stays representable), which can
    leave the other edge a little outside the grid's span: there the error also includes that overhang."""
    bits = data.draw(st.sampled_from([2, 3, 4, 5, 6, 8]))
    group = data.draw(st.sampled_from([32, 64, 128]))
    rows = data.draw(st.integers(1, 4))
    groups = data.draw(st.integers(1, 3))
    w = data.draw(np_arrays("float32", shape=st.just((rows, group * groups)), lo=-4, hi=4))
    wq, scales, biases = mx.quantize(mx.array(w), group_size=group, bits=bits)
    assert wq.dtype is mx.uint32 and wq.shape == (rows, group * groups * bits // 32)
    assert scales.shape == biases.shape == (rows, groups)
    d = to_np(mx.dequantize(wq, scales, biases, group_size=group, bits=bits))
    assert d.shape == w.shape and d.dtype == np.float32
    s = np.abs(to_np(scales))[..., None]
    b = to_np(biases)[..., None]
    ends = np.stack([b, b + (2**bits - 1) * to_np(scales)[..., None]])
    lo, hi = ends.min(axis=0), ends.max(axis=0)
    wg, dg = w.reshape(rows, groups, group), d.reshape(rows, groups, group)
    overhang = np.maximum(0, np.maximum(lo - wg, wg - hi))
    err = np.abs(dg - wg)
    assert np.all(err <= s / 2 + overhang + 1e-5 * (1 + np.abs(wg)))
    assert np.all(overhang <= s + 1e-5)  # the overhang is below one step
    # The dequantized values are exactly on the grid: bias + q * scale with 0 <= q < 2**bits.
    q = (dg - b) / to_np(scales)[..., None]
    assert np.all(np.abs(q - np.round(q)) < 1e-2) and q.min() > -0.5 and q.max() < 2**bits - 0.5
    # The same inputs give the same bits as mlx.core (the binding passes group_size/bits/mode through).
    ref = mlx.quantize(mlx.array(w), group_size=group, bits=bits)
    np.testing.assert_array_equal(to_np(wq), np.asarray(ref[0]))
    np.testing.assert_array_equal(to_np(scales), np.asarray(ref[1]))


def test_quantize_other_modes_and_quantized_matmul() -> None:
    w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    wq, scales = mx.quantize(mx.array(w), group_size=32, bits=4, mode="mxfp4")
    back = to_np(mx.dequantize(wq, scales, group_size=32, bits=4, mode="mxfp4"))
    assert np.abs(back - w).max() < 0.5 * np.abs(w).max()
    wq, scales, biases = mx.quantize(mx.array(w), group_size=64, bits=8)
    x = mx.array(np.ones((2, 64), np.float32))
    out = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=8)
    np.testing.assert_allclose(to_np(out), np.ones((2, 64)) @ w.T, atol=0.1)
