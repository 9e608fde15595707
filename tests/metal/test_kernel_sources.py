"""Kernel bodies shared by a family's CUDA and Metal kernels, written out per dialect
(metal_kernel.dialect), and the device kind every kernel family asks (metal_kernel.device_kind)."""
from __future__ import annotations

import pytest

import pymlxc.core as mx
from pymlxc.backends.metal.kernels import gated_delta, gguf_blocks, metal_kernel
from pymlxc.backends.metal.kernels.metal_kernel import dialect

BODY = """  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const DEVICE T* p = x + i;
    s = fmaf(p[0], 2.f, s);
  }
  WARP_SUM s
"""


def test_dialect_writes_cuda_and_metal() -> None:
    assert dialect(BODY, cuda=True) == """  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const T* p = x + i;
    s = fmaf(p[0], 2.f, s);
  }
  for (int off = 16; off > 0; off >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, off);
  }
"""
    assert dialect(BODY, cuda=False) == """  float s = 0.f;
  for (int i = 0; i < 8; ++i) {
    const device T* p = x + i;
    s = fma(p[0], 2.f, s);
  }
  s = simd_sum(s);
"""


@pytest.mark.parametrize(("cuda", "metal"), [(gated_delta.CUDA_SOURCE, gated_delta.METAL_SOURCE),
                                             (gguf_blocks.CUDA_MATVEC_SOURCE, gguf_blocks.METAL_MATVEC_SOURCE)])
def test_family_sources_hold_no_marker_of_the_other_dialect(cuda: str, metal: str) -> None:
    for source in (cuda, metal):
        assert "WARP_SUM" not in source and "DEVICE" not in source
    assert "__shfl_xor_sync" in cuda and "simd_sum" not in cuda and "device " not in cuda
    assert "simd_sum" in metal and "#pragma" not in metal and "__shfl" not in metal and "fmaf" not in metal
    assert cuda.count("__shfl_xor_sync") == metal.count("simd_sum")


def test_kernel_families_share_one_device_kind() -> None:
    assert gated_delta.device_kind is metal_kernel.device_kind is gguf_blocks.device_kind
    expected = None
    if mx.default_device().type == "gpu":
        expected = "cuda" if mx.cuda_available() else "metal" if mx.metal_available() else None
    assert metal_kernel.device_kind() == expected
