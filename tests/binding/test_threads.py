"""Calls from several Python threads: each gets a usable default stream, and concurrent ops give the
right results."""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import pymlxc.core as mx

from .strategies import to_np


def run_in_threads(n: int, work: Callable[[int], object]) -> list[object]:
    barrier = threading.Barrier(n)

    def start(i: int) -> object:
        barrier.wait()  # all threads call MLX at the same time
        return work(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(start, range(n)))


def test_each_thread_gets_a_usable_default_stream() -> None:
    def work(i: int) -> tuple[str, float]:
        stream = mx.default_stream()
        a = mx.array([float(i), 1.0]) * 2.0
        mx.synchronize()
        return repr(stream), mx.sum(a).item()

    results = run_in_threads(4, work)
    assert [r[1] for r in results] == [2.0 * i + 2.0 for i in range(4)]
    # A thread started before any op of its own works at once, and stream_scope stays per thread.
    seen: list[float] = []

    def scoped() -> None:
        with mx.stream_scope(mx.cpu):
            seen.append((mx.ones((2,)) + 1).sum().item())

    t = threading.Thread(target=scoped)
    t.start()
    t.join()
    assert seen == [4.0]


def _checked_ops(seed: int) -> int:
    """Varied ops on one thread, each checked against numpy; returns how many were checked."""
    rng = np.random.default_rng(seed)
    checked = 0
    for step in range(40):
        x = rng.standard_normal((8, 6)).astype(np.float32)
        y = rng.standard_normal((6, 5)).astype(np.float32)
        a, b = mx.array(x), mx.array(y)
        kind = step % 8
        if kind == 0:
            got, want = a @ b, x @ y
        elif kind == 1:
            got, want = mx.exp(a) * 2.0 + 1.0, np.exp(x) * 2 + 1
        elif kind == 2:
            got, want = mx.sum(a, axis=1, keepdims=True), x.sum(axis=1, keepdims=True)
        elif kind == 3:
            got, want = a[::2, 1:4].T, x[::2, 1:4].T
        elif kind == 4:
            got, want = mx.softmax(a, axis=-1), np.exp(x) / np.exp(x).sum(-1, keepdims=True)
        elif kind == 5:
            c = mx.array(x)
            c[1:3] = 0.0
            want = x.copy()
            want[1:3] = 0
            got = c
        elif kind == 6:
            got, want = mx.grad(lambda v: mx.sum(v * v))(a), 2 * x
        else:
            got, want = mx.compile(lambda u, v: mx.maximum(u, 0.0) @ v)(a, b), np.maximum(x, 0) @ y
        np.testing.assert_allclose(to_np(got), want, rtol=1e-4, atol=1e-4)
        checked += 1
    return checked


def test_concurrent_ops_from_four_threads_are_correct() -> None:
    assert run_in_threads(4, _checked_ops) == [40] * 4


def test_threads_share_arrays_and_free_their_own() -> None:
    shared = mx.array(np.arange(12, dtype=np.float32).reshape(3, 4))
    mx.eval(shared)

    def work(i: int) -> float:
        total = 0.0
        for _ in range(50):
            t = shared * float(i) + 1.0
            total += mx.sum(t).item()
            t.free()
        return total

    results = run_in_threads(4, work)
    assert results == [50 * (66.0 * i + 12.0) for i in range(4)]
    assert shared.tolist()[2] == [8.0, 9.0, 10.0, 11.0]


def test_errors_stay_in_their_thread() -> None:
    def work(i: int) -> str:
        if i % 2:
            try:
                mx.reshape(mx.ones((2, 3)), (5,))
            except mx.MLXError as exc:
                return str(exc)
            return "no error"
        return str((mx.ones((2,)) * i).tolist())

    results = run_in_threads(4, work)
    assert results[0] == "[0.0, 0.0]" and results[2] == "[2.0, 2.0]"
    assert "Cannot reshape array of size 6 into shape (5)" in results[1] and results[1] == results[3]
