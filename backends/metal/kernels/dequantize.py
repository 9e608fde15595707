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

One call dequantizes up to MAX_WEIGHTS weights of one dtype and group size (a prefill segment's
products), its grid over their words one weight after the other: each call of a custom kernel costs
MLX and the binding host time (about 9 and 30 us, docs/performance.md), which a short prefill of a
small model is bound by.

This module holds only the source and the launch geometry; `kernel_choice.py` applies it.
"""
from __future__ import annotations

from typing import Any

NAME = "pymlxc_dequantize4"
INPUTS = ("w", "scales", "biases")
OUTPUT_NAMES = ("out",)
THREADS = 256
GROUP_SIZES = (32, 64, 128)

# Template arguments: T (the scales' and the output's 2-byte type), G (group size).
HEADER = r"""
namespace pymlxc_dequantize {

// Word t of a weight w [N, K / 8] (uint32) -> values 8 t .. 8 t + 7 of out [N, K].
template <typename T, int G>
__device__ __forceinline__ void word(const uint32_t* w, const T* scales, const T* biases, T* out, size_t t) {
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
}

}  // namespace pymlxc_dequantize
"""

# The most weights one call dequantizes (a layer's products: q/k/v, o, gate/up, down, apart or fused).
MAX_WEIGHTS = 8


def name(count: int) -> str:
    """The kernel of `count` weights."""
    return f"{NAME}_x{count}"


def inputs(count: int) -> tuple[str, ...]:
    """Its inputs: each weight's packed words, scales and biases, weight by weight."""
    return tuple(f"{part}{i}" for i in range(count) for part in INPUTS)


def outputs(count: int) -> tuple[str, ...]:
    """Its outputs, a dequantized weight each."""
    return tuple(f"{OUTPUT_NAMES[0]}{i}" for i in range(count))


def source(count: int) -> str:
    """One call for `count` weights: the grid covers their words one weight after the other, and
    each thread finds its weight by subtracting the word counts before it."""
    if not 1 <= count <= MAX_WEIGHTS:
        raise ValueError(f"the dequantization kernel takes 1 to {MAX_WEIGHTS} weights, not {count}")
    parts = ["  size_t t = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;"]
    for i in range(count):
        parts.append(f"""  {{
    const size_t words = static_cast<size_t>(w{i}_shape[0]) * w{i}_shape[1];
    if (t < words) {{
      pymlxc_dequantize::word<T, G>(w{i}, scales{i}, biases{i}, out{i}, t);
      return;
    }}
    t -= words;
  }}""")
    return "\n".join(parts) + "\n"


def applies(bits: int, group_size: int, dtype_size: int) -> bool:
    """Whether the kernel dequantizes this layout: 4 bits, a group size it knows, a 2-byte dtype."""
    return bits == 4 and group_size in GROUP_SIZES and dtype_size == 2


def launch(words: int, dtype: Any, group_size: int) -> dict[str, Any]:
    """Keyword arguments of a kernel call for weights of `words` packed words in all."""
    return {"grid": (-(-words // THREADS) * THREADS, 1, 1), "threadgroup": (THREADS, 1, 1),
            "template": [("T", dtype), ("G", group_size)]}


__all__ = ["GROUP_SIZES", "HEADER", "INPUTS", "MAX_WEIGHTS", "NAME", "OUTPUT_NAMES", "THREADS", "applies", "inputs",
           "launch", "name", "outputs", "source"]
