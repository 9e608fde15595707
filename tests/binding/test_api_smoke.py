"""Smoke tests of the device, stream and memory API, and of the fft, linalg and random modules (on
the CPU, against numpy)."""
from __future__ import annotations

import numpy as np
import pytest

import pymlxc.core as mx

from .strategies import to_np


def test_devices_and_streams() -> None:
    assert isinstance(mx.metal_available(), bool) and isinstance(mx.cuda_available(), bool)
    assert mx.default_device() in (mx.cpu, mx.gpu)
    assert mx.is_available(mx.cpu) and mx.device_count("cpu") >= 1
    assert mx.is_available(mx.gpu) == (mx.metal_available() or mx.cuda_available())
    info = mx.device_info(mx.cpu)
    assert info and all(isinstance(k, str) and isinstance(v, (str, int)) for k, v in info.items())
    assert mx.device_info()  # the default device
    s = mx.new_stream(mx.cpu)
    assert s.device == mx.cpu and "cpu" in repr(s)
    for stream in (s, mx.cpu, "cpu", None):
        assert mx.add(mx.ones((2,)), 1.0, stream=stream).tolist() == [2.0, 2.0]
    with mx.stream_scope(s) as scoped:
        assert scoped is s and mx.default_stream() is s
        assert (mx.ones((2,)) * 3).tolist() == [3.0, 3.0]
    assert mx.default_stream() is not s
    s.synchronize()
    mx.synchronize()
    mx.synchronize(s)
    with pytest.raises(ValueError):
        mx.Device("tpu")


def test_memory_controls() -> None:
    for name in ["get_active_memory", "get_peak_memory", "get_cache_memory", "get_memory_limit"]:
        assert isinstance(getattr(mx, name)(), int) and getattr(mx, name)() >= 0
    previous = mx.set_cache_limit(1 << 20)
    assert isinstance(previous, int)
    assert mx.set_cache_limit(previous) == 1 << 20
    limit = mx.set_memory_limit(1 << 34)
    assert mx.get_memory_limit() == 1 << 34
    mx.set_memory_limit(limit)
    assert isinstance(mx.set_wired_limit(0), int)
    mx.reset_peak_memory()
    a = mx.zeros((256, 256))
    mx.eval(a)
    assert mx.get_peak_memory() >= 256 * 256 * 4
    del a
    mx.clear_cache()
    assert mx.get_cache_memory() == 0


@pytest.fixture(autouse=True)
def _on_cpu():
    with mx.stream_scope(mx.cpu):  # linalg runs on the CPU only; fft compares with numpy there
        yield


def test_fft_against_numpy() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    c = (x + 1j * rng.standard_normal((4, 8))).astype(np.complex64)
    a, ca = mx.array(x), mx.array(c)
    close = lambda got, want: np.testing.assert_allclose(to_np(got), want, rtol=1e-4, atol=1e-4)  # noqa: E731
    close(mx.fft.fft(a), np.fft.fft(x))
    close(mx.fft.ifft(ca), np.fft.ifft(c))
    close(mx.fft.rfft(a), np.fft.rfft(x))
    close(mx.fft.irfft(mx.fft.rfft(a)), x)
    close(mx.fft.fft(a, n=5, axis=0), np.fft.fft(x, n=5, axis=0))
    close(mx.fft.fft2(ca), np.fft.fft2(c))
    close(mx.fft.fftn(ca), np.fft.fftn(c))
    close(mx.fft.rfft2(a), np.fft.rfft2(x))
    close(mx.fft.irfftn(mx.fft.rfftn(a)), x)
    close(mx.fft.fft(a, norm="ortho"), np.fft.fft(x, norm="ortho"))
    close(mx.fft.fftshift(a), np.fft.fftshift(x))
    close(mx.fft.ifftshift(a, axes=[1]), np.fft.ifftshift(x, axes=[1]))
    with pytest.raises(ValueError, match="norm"):
        mx.fft.fft(a, norm="bad")


def test_linalg_against_numpy() -> None:
    rng = np.random.default_rng(1)
    m = rng.standard_normal((4, 4)).astype(np.float32)
    spd = (m @ m.T + 4 * np.eye(4)).astype(np.float32)
    b = rng.standard_normal((4, 2)).astype(np.float32)
    a = mx.array(m)
    close = lambda got, want, tol=1e-4: np.testing.assert_allclose(to_np(got), want, rtol=tol, atol=tol)  # noqa: E731
    close(mx.linalg.norm(a), np.linalg.norm(m))
    close(mx.linalg.norm(a, axis=1), np.linalg.norm(m, axis=1))
    close(mx.linalg.norm(a, ord=1, axis=0), np.linalg.norm(m, ord=1, axis=0))
    close(mx.linalg.norm(a, ord="fro"), np.linalg.norm(m, "fro"))
    close(mx.linalg.inv(a), np.linalg.inv(m), 1e-3)
    close(mx.linalg.solve(mx.array(spd), mx.array(b)), np.linalg.solve(spd, b))
    q, r = mx.linalg.qr(a)
    close(q @ r, m)
    close(mx.matmul(q.T, q), np.eye(4))
    u, s, vt = mx.linalg.svd(a)
    close(s, np.linalg.svd(m, compute_uv=False))
    close((u * s) @ vt, m)
    close(mx.linalg.svd(a, compute_uv=False), np.linalg.svd(m, compute_uv=False))
    low = mx.linalg.cholesky(mx.array(spd))
    close(low @ low.T, spd, 1e-3)
    w, v = mx.linalg.eigh(mx.array(spd))
    close(w, np.linalg.eigvalsh(spd), 1e-3)
    close(mx.linalg.eigvalsh(mx.array(spd)), np.linalg.eigvalsh(spd), 1e-3)
    close(mx.array(spd) @ v, to_np(v) * to_np(w), 1e-3)
    close(mx.linalg.pinv(a), np.linalg.pinv(m), 1e-3)
    close(mx.linalg.cross(mx.array([1.0, 0, 0]), mx.array([0.0, 1, 0])), [0, 0, 1])
    tri = np.triu(spd)
    close(mx.linalg.solve_triangular(mx.array(tri), mx.array(b), upper=True), np.linalg.solve(tri, b), 1e-3)


def test_random_with_keys() -> None:
    key = mx.random.key(7)
    assert key.dtype is mx.uint32 and key.shape == (2,)
    u1 = mx.random.uniform(shape=(1000,), key=key)
    u2 = mx.random.uniform(shape=(1000,), key=key)
    assert u1.tolist() == u2.tolist()  # same key, same numbers
    x = to_np(u1)
    assert x.min() >= 0 and x.max() < 1 and abs(x.mean() - 0.5) < 0.05
    k1, k2 = mx.random.split(key)
    assert mx.random.normal((4,), key=k1).tolist() != mx.random.normal((4,), key=k2).tolist()
    n = to_np(mx.random.normal((4000,), key=k1, loc=2.0, scale=0.5))
    assert abs(n.mean() - 2.0) < 0.05 and abs(n.std() - 0.5) < 0.05
    r = to_np(mx.random.randint(3, 9, (500,), key=k2))
    assert r.min() >= 3 and r.max() < 9
    assert mx.random.categorical(mx.array([[-1e9, 0.0, -1e9]]), key=key).item() == 1
    assert sorted(mx.random.permutation(6, key=key).tolist()) == list(range(6))
    mx.random.seed(3)
    a = mx.random.uniform(shape=(3,)).tolist()
    mx.random.seed(3)
    assert mx.random.uniform(shape=(3,)).tolist() == a
    assert mx.random.bernoulli(1.0, (3,), key=key).tolist() == [True] * 3


def test_shape_arguments_and_reused_buffers() -> None:
    a = mx.arange(24)
    for shape in [(2, 12), [2, 12], (np.int64(2), 12), (mx.array(2), 12), (2, -1)]:
        assert mx.reshape(a, shape).shape == (2, 12)  # the same buffer serves equal shapes
    assert a.reshape(4, 6).shape == (4, 6) and a.reshape((3, 8)).shape == (3, 8)
    assert mx.sum(mx.ones((2, 3, 4)), axis=(0, 2)).tolist() == [8.0, 8.0, 8.0]
    assert mx.sum(mx.ones((2, 3, 4)), axis=[0, 2]).shape == (3,)
    for start in range(6):  # many distinct slices, each its own buffer
        assert a[start:start + 3].tolist() == list(range(start, start + 3))
        assert a[start].item() == start


def test_default_device_change_keeps_every_thread_on_a_valid_stream() -> None:
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        assert (mx.ones((2,)) + 1).tolist() == [2.0, 2.0]
        seen: list[float] = []
        import threading

        t = threading.Thread(target=lambda: seen.append(mx.sum(mx.ones((3,))).item()))
        t.start()
        t.join()
        assert seen == [3.0]
    finally:
        mx.set_default_device(before)
    assert (mx.ones((2,)) * 2).tolist() == [2.0, 2.0]
