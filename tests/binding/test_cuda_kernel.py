"""`mx.fast.cuda_kernel`: custom CUDA kernels through the binding. Without MLX's CUDA build,
creating one raises a named MLXError; with it, a kernel runs, bad calls raise Python errors, a
kernel that does not compile raises at evaluation, and a closed kernel refuses calls."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc.core as mx


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


def test_shared_kernel_is_made_once_on_first_use() -> None:
    """Made lazily (so a module can hold one without CUDA), then one instance for every thread."""
    import threading

    shared = mx.fast.SharedKernel("k2", ["a"], ["out"], "out[threadIdx.x] = a[threadIdx.x] + 1;")
    if not mx.cuda_available():
        for _ in range(2):  # each call tries again: a failure is not kept as the kernel
            with pytest.raises(mx.MLXError, match="CUDA"):
                shared()
        return
    seen: list[object] = []
    threads = [threading.Thread(target=lambda: seen.append(shared())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 8 and all(k is seen[0] for k in seen)
    out = seen[0]([mx.zeros((4,))], output_shapes=[(4,)], output_dtypes=[mx.float32], grid=(4, 1, 1),
                  threadgroup=(4, 1, 1))
    assert out[0].tolist() == [1.0, 1.0, 1.0, 1.0]


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=-3.4e38, max_value=3.4e38, allow_nan=False, width=64))
def test_float32_bits_are_numpys_float32_rounding(x: float) -> None:
    """A float template constant's bits: `x` rounded to float32 as numpy rounds it, read as int32."""
    import numpy as np

    from pymlxc.core.cuda_kernel import float32_bits

    want = int(np.array([x], dtype=np.float64).astype(np.float32).view(np.int32)[0])
    assert float32_bits(x) == want


def test_launch_configurations_are_kept_per_call_form() -> None:
    """A kernel keeps one mlx-c launch configuration per form of call (shapes, dtypes, grid,
    template, init value), and a call of another form never gets a kept one: the results follow
    each call's own arguments, a bool and an int template argument stay apart, and calls past
    `MAX_CONFIGS` forms still run (on configurations made for the call alone)."""
    if not mx.cuda_available():
        pytest.skip("needs MLX's CUDA build")
    source = "out[threadIdx.x] = static_cast<T>(a[threadIdx.x] * SCALE + (FLAG ? 1000 : 0));"
    kernel = mx.fast.cuda_kernel("configs", ["a"], ["out"], source)
    kernel.MAX_CONFIGS = 6
    a = mx.arange(8, dtype=mx.float32)
    cases = [(n, scale, flag, dtype) for n in (8, 5) for scale in (1, 3) for flag in (True, 1, False)
             for dtype in (mx.float32, mx.int32)]
    for _ in range(2):  # the second pass takes the kept configurations where there are some
        for n, scale, flag, dtype in cases:
            out = kernel([a], output_shapes=[(n,)], output_dtypes=[dtype], grid=(n, 1, 1),
                         threadgroup=(n, 1, 1), template=[("T", dtype), ("SCALE", scale), ("FLAG", flag)])
            want = [i * scale + (1000 if flag else 0) for i in range(n)]
            assert out[0].shape == (n,) and out[0].dtype == dtype and out[0].tolist() == want
    assert len(kernel._configs) == 6
    kernel.close()
    assert kernel._configs == {}
