"""`decode_attention.attend`: one-token attention over the filled slots of a fixed-size buffer.

Checked against a float64 numpy softmax for varied shapes (grouped heads, head sizes, buffers
partly filled or full, strided queries). On MLX's CUDA build this runs the custom kernel (and
`test_runs_the_kernel_on_cuda` makes sure it did); elsewhere it checks the masked path that
replaces it. The binding's custom-kernel entry point itself is checked for clean errors.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal import decode_attention

TOLERANCE = {mx.float32: 2e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}


def reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, pos: int, scale: float) -> np.ndarray:
    b, hq, _, d = q.shape
    hkv, slots = keys.shape[1], keys.shape[2]
    n = min(pos + 1, slots)
    k = np.repeat(keys[:, :, :n].astype(np.float64), hq // hkv, axis=1)
    v = np.repeat(values[:, :, :n].astype(np.float64), hq // hkv, axis=1)
    scores = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k) * scale
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", p, v)


def as_numpy(a: mx.Array) -> np.ndarray:
    return np.asarray(a.astype(mx.float32))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 2), kv_heads=st.sampled_from([1, 2, 4]), rep=st.sampled_from([1, 2, 4]),
       head_dim=st.sampled_from([32, 64, 128, 256]), slots=st.integers(1, 400), fill=st.floats(0.0, 1.5),
       dtype=st.sampled_from([mx.float32, mx.float16, mx.bfloat16]), seed=st.integers(0, 2**16))
def test_attend_matches_a_softmax_over_the_filled_slots(batch: int, kv_heads: int, rep: int, head_dim: int,
                                                         slots: int, fill: float, dtype: mx.Dtype,
                                                         seed: int) -> None:
    pos = min(int(fill * slots), 2 * slots)  # past the end: a full ring, every slot counts
    rng = np.random.default_rng(seed)
    hq = kv_heads * rep
    q = rng.standard_normal((batch, hq, 1, head_dim)).astype(np.float32)
    keys = rng.standard_normal((batch, kv_heads, slots, head_dim)).astype(np.float32)
    values = rng.standard_normal((batch, kv_heads, slots, head_dim)).astype(np.float32)
    # Slots past pos hold large values: reading any of them would show.
    keys[:, :, pos + 1:] = 30.0
    values[:, :, pos + 1:] = 1e3
    scale = head_dim ** -0.5
    q_mx, k_mx, v_mx = (mx.array(a).astype(dtype) for a in (q, keys, values))
    got = decode_attention.attend(q_mx, k_mx, v_mx, mx.array(pos, dtype=mx.int32), scale)
    assert got.shape == (batch, hq, 1, head_dim) and got.dtype == dtype
    want = reference(as_numpy(q_mx), as_numpy(k_mx), as_numpy(v_mx), pos, scale)
    np.testing.assert_allclose(as_numpy(got), want, atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype])


def test_attend_reads_a_strided_query() -> None:
    """In the decode step q is a view of the fused q/k/v projection's output (not contiguous)."""
    rng = np.random.default_rng(0)
    hq, hkv, d, slots, pos = 8, 2, 64, 300, 137
    qkv = mx.array(rng.standard_normal((1, 1, (hq + 2 * hkv) * d)).astype(np.float32)).astype(mx.bfloat16)
    q = mx.reshape(mx.slice(qkv, [0, 0, 0], [1, 1, hq * d], [1, 1, 1]), (1, hq, 1, d))
    keys = mx.array(rng.standard_normal((1, hkv, slots, d)).astype(np.float32)).astype(mx.bfloat16)
    values = mx.array(rng.standard_normal((1, hkv, slots, d)).astype(np.float32)).astype(mx.bfloat16)
    got = decode_attention.attend(q, keys, values, mx.array(pos, dtype=mx.int32), d ** -0.5)
    want = reference(as_numpy(q), as_numpy(keys), as_numpy(values), pos, d ** -0.5)
    np.testing.assert_allclose(as_numpy(got), want, atol=0.1, rtol=3e-2)


def test_kernel_availability_follows_the_device_and_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = mx.cuda_available() and mx.default_device().type == "gpu"
    assert decode_attention.kernel_available() == cuda
    monkeypatch.setenv(decode_attention.ENV_VAR, "0")
    assert not decode_attention.kernel_available()
    assert decode_attention.supports(mx.bfloat16, 64) and decode_attention.supports(mx.bfloat16, 256)
    assert decode_attention.supports(mx.float32, 128) and not decode_attention.supports(mx.float32, 256)
    assert not decode_attention.supports(mx.bfloat16, 96) and not decode_attention.supports(mx.int32, 64)


@pytest.mark.skipif(not (mx.cuda_available() and mx.default_device().type == "gpu"), reason="needs MLX's CUDA build")
def test_runs_the_kernel_on_cuda() -> None:
    """On CUDA the kernel (not the masked fallback) gives these results: they differ from the fallback
    only by rounding, and the fallback is not called."""
    calls = []
    real = decode_attention.by_mask
    decode_attention.by_mask = lambda *a: calls.append(a) or real(*a)  # type: ignore[assignment]
    try:
        q = mx.ones((1, 4, 1, 64), dtype=mx.bfloat16)
        kv = mx.ones((1, 2, 50, 64), dtype=mx.bfloat16)
        out = decode_attention.attend(q, kv, kv, mx.array(10, dtype=mx.int32), 0.125)
        mx.eval(out)
    finally:
        decode_attention.by_mask = real  # type: ignore[assignment]
    assert not calls
    np.testing.assert_allclose(as_numpy(out), 1.0)


def test_cuda_kernel_errors_are_python_exceptions() -> None:
    with pytest.raises(ValueError, match="at least one output"):
        mx.fast.cuda_kernel("k", ["a"], [], "")
    with pytest.raises(ValueError, match="not an identifier"):
        mx.fast.cuda_kernel("k", ["a b"], ["out"], "")
    if not mx.cuda_available():
        with pytest.raises(mx.MLXError, match="CUDA"):
            mx.fast.cuda_kernel("k", ["a"], ["out"], "out[0] = a[0];")
        return
    kernel = mx.fast.cuda_kernel("k", ["a"], ["out"], "out[threadIdx.x] = a[threadIdx.x] * 2;")
    with pytest.raises(ValueError, match="takes 1 inputs"):
        kernel([], output_shapes=[(4,)], output_dtypes=[mx.float32], grid=(4, 1, 1), threadgroup=(4, 1, 1))
    out = kernel([mx.arange(4, dtype=mx.float32)], output_shapes=[(4,)], output_dtypes=[mx.float32],
                 grid=(4, 1, 1), threadgroup=(4, 1, 1), stream="gpu")
    assert out[0].tolist() == [0.0, 2.0, 4.0, 6.0]
    broken = mx.fast.cuda_kernel("broken", ["a"], ["out"], "this is not CUDA;")
    with pytest.raises(mx.MLXError):
        mx.eval(broken([mx.ones((4,))], output_shapes=[(4,)], output_dtypes=[mx.float32], grid=(4, 1, 1),
                       threadgroup=(4, 1, 1)))
    kernel.close()
    with pytest.raises(mx.MLXError, match="closed"):
        kernel([mx.ones((4,))], output_shapes=[(4,)], output_dtypes=[mx.float32], grid=(4, 1, 1),
               threadgroup=(4, 1, 1))
