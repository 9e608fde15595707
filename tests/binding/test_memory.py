"""Creating and freeing many arrays returns MLX's active memory to where it started."""
from __future__ import annotations

import contextlib
import gc

import pymlxc.core as mx

N = 100_000


def settle() -> int:
    gc.collect()
    mx.synchronize()
    return mx.get_active_memory()


def test_explicit_free_of_100k_arrays() -> None:
    start = settle()
    for i in range(N):
        a = mx.array(float(i))  # a scalar: MLX allocates its buffer at once
        a.free()
    assert settle() == start


def test_collected_arrays_release_their_memory() -> None:
    start = settle()
    for i in range(N):
        mx.array(i)  # dropped at once: freed by the collector's destructor
    kept = [mx.array(float(i)) for i in range(1000)]
    assert mx.get_active_memory() > start
    del kept
    assert settle() == start


def test_evaluated_results_and_graphs_are_released() -> None:
    x = mx.ones((64, 64))
    mx.eval(x)
    start = settle()
    for _ in range(300):
        y = mx.exp(x) @ x + 1.0
        y[0, 0] = 2.0
        y.eval()
        z = y[::2, 1:]
        mx.eval(z, mx.sum(z, axis=0))
        del y, z
    assert settle() == start
    peak = mx.get_peak_memory()
    assert peak >= 64 * 64 * 4


def test_results_of_failed_calls_do_not_leak() -> None:
    start = settle()
    for _ in range(2000):
        with contextlib.suppress(mx.MLXError):
            mx.reshape(mx.ones((2, 3)), (4,))
    assert settle() == start


def test_transforms_release_their_graphs() -> None:
    w = mx.ones((32, 32))
    mx.eval(w)
    loss = mx.value_and_grad(lambda v: mx.sum(mx.tanh(v @ v)))
    step = mx.compile(lambda v: mx.tanh(v) * 2)
    mx.eval(step(w))  # the first call traces; the compiled graph keeps its constant (the 2)
    start = settle()
    for _ in range(200):
        value, g = loss(w)
        mx.eval(value, g, step(w))
        del value, g
    assert settle() == start
