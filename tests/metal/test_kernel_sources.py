"""The kernel sources written from one shared loop in two dialects (gated_delta._dialect) and the
device kind every kernel family asks (metal_kernel.device_kind)."""
from __future__ import annotations

import pymlxc.core as mx
from pymlxc.backends.metal.kernels import gated_delta, gguf_blocks, metal_kernel


def test_gated_delta_sources_are_written_out_in_their_dialect() -> None:
    cuda, metal = gated_delta.CUDA_SOURCE, gated_delta.METAL_SOURCE
    for source in (cuda, metal):
        assert "UNROLL" not in source and "WARP_SUM" not in source
        assert source.count("state_out[at + i] = s[i];") == 1
    assert cuda.count("__shfl_xor_sync(0xffffffffu, recall, off)") == 1
    assert cuda.count("__shfl_xor_sync(0xffffffffu, out, off)") == 1
    assert cuda.count("#pragma unroll") == 6 and "simd_sum" not in cuda
    assert metal.count("recall = simd_sum(recall);") == 1 and metal.count("out = simd_sum(out);") == 1
    assert "#pragma" not in metal and "__shfl" not in metal


def test_kernel_families_share_one_device_kind() -> None:
    assert gated_delta.device_kind is metal_kernel.device_kind is gguf_blocks.device_kind
    expected = None
    if mx.default_device().type == "gpu":
        expected = "cuda" if mx.cuda_available() else "metal" if mx.metal_available() else None
    assert metal_kernel.device_kind() == expected
