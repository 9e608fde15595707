"""Gradients against central differences, vjp/jvp consistency, compile and checkpoint against the
plain functions, and exceptions raised inside transformed functions."""
from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pymlxc.core as mx

from .strategies import FEWER, np_arrays, to_np

# Scalar losses of one or two arrays, smooth on the sampled inputs.
LOSSES = {
    "sin*x": lambda x: mx.sum(mx.sin(x) * x),
    "tanh(x@x.T)": lambda x: mx.sum(mx.tanh(x @ x.T)),
    "logsumexp": lambda x: mx.logsumexp(x * 2.0),
    "softmax·x": lambda x: mx.sum(mx.softmax(x, axis=-1) * x),
    "norm": lambda x: mx.sqrt(mx.sum(x * x) + 1.0),
    "slices": lambda x: mx.sum(x[..., ::2] ** 2) - mx.mean(x[:1] * 3.0),
    "exp/(1+x²)": lambda x: mx.sum(mx.exp(x / 4.0) / (1.0 + x * x)),
}


def central_difference(f, x: np.ndarray, eps: float = 1e-3) -> np.ndarray:  # noqa: ANN001
    grad = np.zeros_like(x, dtype=np.float64)
    flat = x.reshape(-1)
    for i in range(flat.size):
        up, down = flat.copy(), flat.copy()
        up[i] += eps
        down[i] -= eps
        grad.reshape(-1)[i] = (f(up.reshape(x.shape)) - f(down.reshape(x.shape))) / (2 * eps)
    return grad


@pytest.mark.parametrize("name", sorted(LOSSES))
@FEWER
@given(x=np_arrays("float32", shape=st.tuples(st.integers(1, 3), st.integers(1, 4)), lo=-2, hi=2))
def test_value_and_grad_against_central_differences(name: str, x: np.ndarray) -> None:
    loss = LOSSES[name]
    with mx.stream_scope(mx.cpu):  # float64, for differences precise enough to compare
        value, grad = mx.value_and_grad(loss)(mx.array(x, mx.float64))
        assert grad.shape == x.shape and grad.dtype is mx.float64
        np.testing.assert_allclose(value.item(), loss(mx.array(x, mx.float64)).item(), rtol=1e-12)
        numeric = central_difference(lambda v: loss(mx.array(v, mx.float64)).item(), x.astype(np.float64), 1e-3)
    np.testing.assert_allclose(to_np(grad), numeric, rtol=1e-3, atol=1e-4)  # MLX float64 exp/sin: ~1e-8 off
    g32 = mx.grad(loss)(mx.array(x))  # and in float32, loosely
    np.testing.assert_allclose(to_np(g32), numeric, rtol=1e-2, atol=1e-3)


def test_grad_argnums_and_trees() -> None:
    x, y = mx.array([0.5, -1.0]), mx.array([2.0, 3.0])
    gx, gy = mx.grad(lambda a, b: mx.sum(a * a * b), argnums=(0, 1))(x, y)
    assert gx.tolist() == [2.0, -6.0] and gy.tolist() == [0.25, 1.0]
    assert mx.grad(lambda a, b: mx.sum(a * b), argnums=1)(x, y).tolist() == [0.5, -1.0]
    params = {"w": x, "layers": [y, {"b": mx.array(1.0)}]}
    grads = mx.grad(lambda p: mx.sum(p["w"] * p["layers"][0]) + p["layers"][1]["b"] * 3.0)(params)
    assert grads["w"].tolist() == [2.0, 3.0] and grads["layers"][0].tolist() == [0.5, -1.0]
    assert grads["layers"][1]["b"].item() == 3.0
    (value, aux), g = mx.value_and_grad(lambda a: (mx.sum(a), a * 2))(x)
    assert value.item() == -0.5 and aux.tolist() == [1.0, -2.0] and g.tolist() == [1.0, 1.0]


@FEWER
@given(x=np_arrays("float32", shape=st.just((3,)), lo=-2, hi=2),
       u=np_arrays("float32", shape=st.just((3,)), lo=-1, hi=1),
       v=np_arrays("float32", shape=st.just((2, 3)), lo=-1, hi=1))
def test_vjp_and_jvp_agree(x: np.ndarray, u: np.ndarray, v: np.ndarray) -> None:
    """<v, J u> computed through jvp equals <Jᵀ v, u> computed through vjp."""
    def f(a: mx.Array) -> mx.Array:
        return mx.stack([mx.sin(a) * a, mx.exp(a / 2.0)])

    outs, (jv,) = mx.jvp(f, [mx.array(x)], [mx.array(u)])
    outs2, (vj,) = mx.vjp(f, [mx.array(x)], [mx.array(v)])
    np.testing.assert_allclose(to_np(outs[0]), to_np(f(mx.array(x))), rtol=1e-6)
    np.testing.assert_allclose(to_np(outs2[0]), to_np(outs[0]), rtol=1e-6)
    np.testing.assert_allclose(np.sum(v * to_np(jv)), np.sum(to_np(vj) * u), rtol=1e-4, atol=1e-5)
    xs = x.astype(np.float64)  # and against the analytic Jacobian
    jac = np.concatenate([np.diag(np.cos(xs) * xs + np.sin(xs)), np.diag(np.exp(xs / 2) / 2)])
    np.testing.assert_allclose(to_np(jv), (jac @ u).reshape(2, 3), rtol=1e-4, atol=1e-5)


GRAPHS = {
    "elementwise": lambda a, b: mx.exp(a) * b + 1.0,
    "matmul+softmax": lambda a, b: mx.softmax(a @ b.T, axis=-1),
    "reduce+broadcast": lambda a, b: a - mx.mean(b, axis=-1, keepdims=True),
    "tuple out": lambda a, b: (a + b, mx.maximum(a, b)),
    "indexing": lambda a, b: a[:, ::-1] * b[0],
}


@pytest.mark.parametrize("name", sorted(GRAPHS))
@FEWER
@given(data=st.data())
def test_compile_equals_uncompiled(name: str, data: st.DataObject) -> None:
    fn = GRAPHS[name]
    compiled = mx.compile(fn)
    # Shapeless only for elementwise graphs: MLX 0.32.4 itself crashes replaying mean(keepdims=True)
    # shapelessly at a new shape (mlx.core too).
    shapeless = mx.compile(fn, shapeless=True) if name in ("elementwise", "tuple out") else None
    for _ in range(2):  # two shapes: a retrace (or, shapeless, a replay)
        shape = data.draw(st.tuples(st.integers(1, 4), st.integers(1, 5)))
        a = mx.array(data.draw(np_arrays("float32", shape=st.just(shape), lo=-2, hi=2)))
        b = mx.array(data.draw(np_arrays("float32", shape=st.just(shape), lo=-2, hi=2)))
        want = fn(a, b)
        for f in [compiled, shapeless]:
            if f is None:
                continue
            got = f(a, b)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                            strict=True):
                assert g.shape == w.shape
                np.testing.assert_allclose(to_np(g), to_np(w), rtol=1e-5, atol=1e-6)


def test_shapeless_compile_traces_once() -> None:
    calls = []

    def fn(x: mx.Array) -> mx.Array:
        calls.append(x.shape)
        return x * 2.0 + 1.0

    f = mx.compile(fn, shapeless=True)
    for n in (3, 5, 8):
        assert f(mx.ones((n,))).tolist() == [3.0] * n
    assert len(calls) == 1
    g = mx.compile(fn)
    calls.clear()
    for n in (3, 5, 3):
        g(mx.ones((n,))).eval()
    assert len(calls) == 2  # once per shape


def test_checkpoint_equals_plain() -> None:
    def block(x: mx.Array, w: mx.Array) -> mx.Array:
        return mx.tanh(x @ w) * 2.0

    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((4, 3)).astype(np.float32))
    w = mx.array(rng.standard_normal((3, 3)).astype(np.float32))
    ck = mx.checkpoint(block)
    np.testing.assert_allclose(to_np(ck(x, w)), to_np(block(x, w)), rtol=1e-6)
    plain = mx.grad(lambda v: mx.sum(block(x, v) ** 2))(w)
    checked = mx.grad(lambda v: mx.sum(ck(x, v) ** 2))(w)
    np.testing.assert_allclose(to_np(checked), to_np(plain), rtol=1e-5)


class Boom(Exception):
    pass


def boom(*_: mx.Array) -> mx.Array:
    raise Boom("raised inside")


@pytest.mark.parametrize("transform", ["compile", "grad", "value_and_grad", "vjp", "jvp", "checkpoint",
                                       "grad of compiled", "compiled in grad"])
def test_exceptions_inside_transforms_are_reraised_as_themselves(transform: str) -> None:
    x = mx.array([1.0, 2.0])
    run = {
        "compile": lambda: mx.compile(boom)(x),
        "grad": lambda: mx.grad(boom)(x),
        "value_and_grad": lambda: mx.value_and_grad(boom)(x),
        "vjp": lambda: mx.vjp(boom, [x], [x]),
        "jvp": lambda: mx.jvp(boom, [x], [x]),
        "checkpoint": lambda: mx.checkpoint(boom)(x),
        "grad of compiled": lambda: mx.grad(mx.compile(boom))(x),
        "compiled in grad": lambda: mx.grad(lambda v: mx.sum(mx.compile(boom)(v)))(x),
    }[transform]
    for _ in range(2):
        with pytest.raises(Boom, match="raised inside"):
            run()
        gc.collect()  # tracebacks hold the closures: collecting them must not hang or crash
    # Everything still works afterwards, transforms included.
    assert mx.grad(lambda v: mx.sum(v * v))(x).tolist() == [2.0, 4.0]
    assert mx.compile(lambda v: v + 1.0)(x).tolist() == [2.0, 3.0]


def test_errors_from_mlx_inside_a_transform() -> None:
    with pytest.raises(mx.MLXError, match="broadcast"):
        mx.grad(lambda v: mx.sum(v + mx.ones((3,))))(mx.ones((2,)))
    with pytest.raises(mx.MLXError, match="broadcast"):
        mx.compile(lambda v: v + mx.ones((3,)))(mx.ones((2,)))
    assert mx.grad(lambda v: mx.sum(v))(mx.ones((2,))).tolist() == [1.0, 1.0]


def test_nested_transforms() -> None:
    x = mx.array([0.5, -1.0, 2.0])
    second = mx.grad(lambda v: mx.sum(mx.grad(lambda u: mx.sum(u ** 3))(v)))(x)
    np.testing.assert_allclose(to_np(second), 6 * to_np(x), rtol=1e-6)
    compiled_grad = mx.compile(mx.grad(lambda v: mx.sum(mx.sin(v))))
    np.testing.assert_allclose(to_np(compiled_grad(x)), np.cos(to_np(x)), rtol=1e-6)
    grad_of_compiled = mx.grad(mx.compile(lambda v: mx.sum(mx.sin(v))))
    np.testing.assert_allclose(to_np(grad_of_compiled(x)), np.cos(to_np(x)), rtol=1e-6)
