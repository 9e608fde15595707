"""MLX's affine 4-bit dequantization for CUDA at the card's copy rate: `dequantize(w, scales,
biases).` for a whole weight, which the compiled prefill makes before each segment and hands to its
trace as an input (`decode/prefill.py`, `Settings.prefill_dequantize_kernel`).

MLX's own `dequantize` wrote Llama-3.1-8B's gate/up weights (235 MB of bfloat16) in 255-326 us on an
H200, about 1 TB/s, and the same values as shifts, masks and a multiply-add fused by MLX's compiler
in 207-227 us (`benchmarks/profile/probe_qmm.py`'s `dequantize_g*` and `elementwise_g*` sides). Here
each thread takes one packed word: its 8 codes share one group (G is a multiple of 8), so one scale
and one bias, and it writes the 8 values as one 16-byte store: 103 us, about 2.9 TB/s
(`kernel_dequantize_g*`).

Each value is `scale * code + bias` as one float fused multiply-add rounded once to T: MLX's CUDA
dequantization writes `scale * code + bias` in T, which the compiler contracts into one fused
multiply-add of T (rounding the product to T first, as MLX's CPU dequantization does, gave values a
quantization step's rounding away from it where the bias cancels the product).

This module holds only the source and the launch geometry; `kernel_choice.py` applies it.
"""
from __future__ import annotations

from typing import Any

NAME = "pymlxc_dequantize4"
INPUTS = ("w", "scales", "biases")
OUTPUT_NAMES = ("out",)
THREADS = 256
GROUP_SIZES = (32, 64, 128)

# Template arguments: T (the scales' and the output's 2-byte type), G (group size). w [N, K / 8]
# uint32 -> out [N, K]; thread t reads word t and writes values 8 t .. 8 t + 7.
SOURCE = r"""
  const size_t words = static_cast<size_t>(w_shape[0]) * w_shape[1];
  const size_t t = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= words) {
    return;
  }
  const uint32_t q = w[t];
  const size_t g = (t * 8) / G;
  const float s = static_cast<float>(scales[g]);
  const float b = static_cast<float>(biases[g]);
  alignas(16) T v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[i] = static_cast<T>(__fmaf_rn(s, static_cast<float>((q >> (4 * i)) & 15u), b));
  }
  *reinterpret_cast<uint4*>(out + t * 8) = *reinterpret_cast<const uint4*>(v);
"""


def applies(bits: int, group_size: int, dtype_size: int) -> bool:
    """Whether the kernel dequantizes this layout: 4 bits, a group size it knows, a 2-byte dtype."""
    return bits == 4 and group_size in GROUP_SIZES and dtype_size == 2


def launch(words: int, dtype: Any, group_size: int) -> dict[str, Any]:
    """Keyword arguments of a kernel call for a weight of `words` packed words."""
    return {"grid": (-(-words // THREADS) * THREADS, 1, 1), "threadgroup": (THREADS, 1, 1),
            "template": [("T", dtype), ("G", group_size)]}


__all__ = ["GROUP_SIZES", "INPUTS", "NAME", "OUTPUT_NAMES", "SOURCE", "THREADS", "applies", "launch"]
