"""`MetalKernel`, the Metal twin of `mx.fast.cuda_kernel` (both `FastKernel`): bad names and bad
calls raise Python errors naming the kernel, a machine without Metal gets MLX's own MLXError, and a
closed kernel refuses calls."""
from __future__ import annotations

import pytest

import pymlxc.core as mx
from pymlxc.backends.metal.kernels.metal_kernel import MetalKernel, SharedMetalKernel


def _call(kernel: MetalKernel, inputs: list[mx.Array]) -> list[mx.Array]:
    return kernel(inputs, output_shapes=[(4,)], output_dtypes=[mx.float32], grid=(4, 1, 1), threadgroup=(4, 1, 1))


def test_metal_kernel_errors_are_python_exceptions() -> None:
    with pytest.raises(ValueError, match="a Metal kernel needs at least one output"):
        MetalKernel("k", ["a"], [], "")
    with pytest.raises(ValueError, match="'a b' is not an identifier"):
        MetalKernel("k", ["a b"], ["out"], "")
    kernel = MetalKernel("twice", ["a"], ["out"], "out[thread_position_in_grid.x] = 2 * a[thread_position_in_grid.x];")
    assert (kernel.name, kernel.mlx_name, kernel.input_names, kernel.output_names) == ("twice", "twice", ("a",),
                                                                                        ("out",))
    with pytest.raises(ValueError, match="kernel 'twice' takes 1 inputs \\(a\\), got 0"):
        _call(kernel, [])
    with pytest.raises(ValueError, match="kernel 'twice' has 1 outputs"):
        kernel([mx.ones((4,))], output_shapes=[], output_dtypes=[], grid=(4, 1, 1), threadgroup=(4, 1, 1))
    if mx.metal_available():
        assert _call(kernel, [mx.arange(4, dtype=mx.float32)])[0].tolist() == [0.0, 2.0, 4.0, 6.0]
    else:
        with pytest.raises(mx.MLXError, match="Metal"):
            mx.eval(_call(kernel, [mx.ones((4,))]))
    kernel.close()
    kernel.close()  # idempotent
    with pytest.raises(mx.MLXError, match="Metal kernel 'twice' was closed"):
        _call(kernel, [mx.ones((4,))])


def test_shared_metal_kernel_is_one_kernel() -> None:
    shared = SharedMetalKernel("plus_one", ["a"], ["out"], "out[0] = a[0] + 1;")
    assert shared() is shared()
    assert shared().name == "plus_one"
