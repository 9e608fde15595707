"""The residual add and the RMSNorm after it as one CUDA kernel, for the decode segments.

A Llama-family decode step ends each half-block with `h = h + out` and normalizes h for the next
projection: two kernels, MLX's add and its `rms_norm`. On an H100 a Llama-3.2-1B step is bound by
the device, and 149 of its 214 kernels move a few kilobytes each (`benchmarks/profile/probe_cuda_graphs.py`
counts them); timed alone each takes 2.8-4.8 us, mostly launch and tail. This kernel does both in
one: it writes `h + out` and its normalized form, 32 kernels fewer per step there (measured: about
1 us of step time saved per kernel removed).

It reproduces MLX's arithmetic exactly, so the tokens do not change: the add in the 2-byte type,
then MLX's `rms_norm_small` (the same threads per block, the same elements per thread in the same
order, the same warp and block reductions, `rsqrt(sum / D + eps)`, and `w * T(x * normalizer)`).
So it applies only where MLX would use that kernel: a 2-byte float type and a row of whole 16-byte
vectors, at most 8192 values (`geometry` gives MLX's threads and loads per thread: Llama-3.2-1B's
2048 is 128 threads of 2). `check()` runs it once against MLX's
two kernels on random rows and keeps MLX's where they differ in any bit, or where it cannot run.

This module holds the source and the launch geometry; `segments.py` decides where to use it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core.cuda_kernel import SharedKernel, float32_bits

from .check import CheckedOnce

NAME = "pymlxc_add_rms_norm"
INPUTS = ("a", "b", "w")
OUTPUTS = ("sum", "normed")
READS = 8  # 2-byte elements per 16-byte load, as MLX's N_READS

# MLX's `rms_norm_small` arithmetic, shared with the normalized form of the matvec kernel
# (`kernels/matvec.py`), which normalizes its input the same way inside each of its blocks.
HEADER = r"""
#include <cooperative_groups/reduce.h>

namespace pymlxc_rms {

// 1 / sqrt(mean(x^2) + eps) of a row held by a block in 16-byte vectors of T: thread tid < NB holds
// vectors NB * i + tid (i < NCH; none past the row's D / 8, which MLX's unaligned kernel reads as
// zeros), threads from NB on hold none. MLX's order: each thread's squares in turn, a warp sum, then
// the warps' sums (`partial`, NB / 32 floats of shared memory) summed by each warp.
template <typename T, int NB, int NCH, int D>
__device__ __forceinline__ float inverse_rms(const uint4 (&v)[NCH], float* partial, float eps) {
  namespace cg = cooperative_groups;
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int tid = threadIdx.x;
  float normalizer = 0.f;
  if (tid < NB) {
#pragma unroll
    for (int i = 0; i < NCH; ++i) {
      if (NB * i + tid >= D / 8) continue;
      const T* e = reinterpret_cast<const T*>(&v[i]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float t = static_cast<float>(e[j]);
        normalizer += t * t;
      }
    }
  }
  float total = cg::reduce(warp, normalizer, cg::plus<float>());
  if (NB > 32) {
    if (warp.thread_rank() == 0 && warp.meta_group_rank() < NB / 32) {
      partial[warp.meta_group_rank()] = total;
    }
    block.sync();
    total = warp.thread_rank() < NB / 32 ? partial[warp.thread_rank()] : 0.f;
    total = cg::reduce(warp, total, cg::plus<float>());
  }
  return rsqrt(total / static_cast<uint32_t>(D) + eps);
}

// w * T(x * inv) for the 8 values of a vector, in place: MLX's weighted normalization.
template <typename T>
__device__ __forceinline__ void scale_vector(uint4& x, const uint4& w, float inv) {
  const T* we = reinterpret_cast<const T*>(&w);
  T* xe = reinterpret_cast<T*>(&x);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float y = static_cast<float>(xe[j]) * inv;
    xe[j] = we[j] * static_cast<T>(y);
  }
}

}  // namespace pymlxc_rms
"""

# Template arguments: T (the 2-byte float type), BLOCK (threads per row), CHUNKS (16-byte loads per
# thread), D (the row length, READS * BLOCK * CHUNKS), EPS_BITS (eps as float32 bits). One block per
# row. eps is a compile-time constant, not an input: MLX's CUDA allocator keeps arrays of 8 bytes or
# less in managed memory the host can read at once, which a kernel reads at about PCIe latency. Under
# Nsight Compute on an H100 (Llama-3.1-8B rows) this kernel took 6.3 us reading eps and the weight
# after the reduction, 3.8 us with both reads issued first, 3.2 us without the eps read
# (benchmarks/results/h100-kernel-times-llama-cpp.json).
SOURCE = r"""
  __shared__ float partial[BLOCK / 32 > 0 ? BLOCK / 32 : 1];
  const size_t row = blockIdx.x;
  const int tid = threadIdx.x;
  const uint4* a4 = reinterpret_cast<const uint4*>(a + row * D);
  const uint4* b4 = reinterpret_cast<const uint4*>(b + row * D);
  uint4* s4 = reinterpret_cast<uint4*>(sum + row * D);
  uint4* n4 = reinterpret_cast<uint4*>(normed + row * D);
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  // The row's 16-byte vectors: BLOCK * CHUNKS of them, or fewer where MLX runs its unaligned
  // kernel, whose loads past the row give zeros (adding 0 to the sum changes no bit: skipped here).
  constexpr int VECTORS = D / 8;

  // Every load is issued before any arithmetic (the weight's too, which the normalization needs
  // only after the reduction): one memory round trip per block rather than two.
  uint4 xs[CHUNKS];
  uint4 av4[CHUNKS];
  uint4 bv4[CHUNKS];
  uint4 wv4[CHUNKS];
#pragma unroll
  for (int i = 0; i < CHUNKS; ++i) {
    const int offset = BLOCK * i + tid;
    if (offset >= VECTORS) continue;
    av4[i] = a4[offset];
    bv4[i] = b4[offset];
    wv4[i] = w4[offset];
  }
#pragma unroll
  for (int i = 0; i < CHUNKS; ++i) {
    const int offset = BLOCK * i + tid;
    if (offset >= VECTORS) continue;
    uint4 av = av4[i];
    uint4 bv = bv4[i];
    const T* ae = reinterpret_cast<const T*>(&av);
    const T* be = reinterpret_cast<const T*>(&bv);
    T* xe = reinterpret_cast<T*>(&xs[i]);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      xe[j] = ae[j] + be[j];
    }
    s4[offset] = xs[i];
  }
  const float inv = pymlxc_rms::inverse_rms<T, BLOCK, CHUNKS, D>(xs, partial, __int_as_float(EPS_BITS));
#pragma unroll
  for (int i = 0; i < CHUNKS; ++i) {
    const int offset = BLOCK * i + tid;
    if (offset >= VECTORS) continue;
    pymlxc_rms::scale_vector<T>(xs[i], wv4[i], inv);
    n4[offset] = xs[i];
  }
"""


def geometry(d: int) -> tuple[int, int] | None:
    """(threads per row, 16-byte loads per thread) of MLX's `rms_norm_small` for rows of `d` 2-byte
    floats (its `dispatch_num_chunks`), or None where MLX uses another kernel (then so must we) or a
    vector would straddle the row's end. Where threads x loads x 8 exceeds `d`, MLX runs the kernel's
    unaligned form (Gemma-3-1B's 1152: 128 threads of 2 loads), which this kernel reproduces by
    skipping the vectors past the row."""
    if d % READS:
        return None
    vectors = d // READS
    if d <= READS * 64:
        return 64, 1
    for block in (128, 64):  # MLX's order: 128 threads first
        if vectors % block == 0 and vectors // block <= 8:
            return block, vectors // block
    if d <= READS * 128 * 8:
        return 128, -(-vectors // 128)
    return None


def applies(d: int, dtype: Any) -> bool:
    return dtype.size == 2 and dtype in (mx.bfloat16, mx.float16) and geometry(d) is not None


_the_kernel = SharedKernel(NAME, INPUTS, OUTPUTS, SOURCE, header=HEADER)


def add_rms_norm(a: Array, b: Array, weight: Array, eps: float) -> tuple[Array, Array]:
    """(a + b, rms_norm(a + b) * weight) in one kernel; `applies(a.shape[-1], a.dtype)` must hold,
    a, b of one shape and dtype, weight [D] of that dtype."""
    d = a.shape[-1]
    shape = geometry(d)
    if shape is None:  # callers check applies() first
        raise ValueError(f"add_rms_norm has no kernel geometry for rows of {d} values; check applies() first")
    block, chunks = shape
    rows = a.size // d
    outs = _the_kernel()([a, b, weight],
                         output_shapes=[tuple(a.shape), tuple(a.shape)], output_dtypes=[a.dtype, a.dtype],
                         grid=(rows * block, 1, 1), threadgroup=(block, 1, 1),
                         template=[("T", a.dtype), ("BLOCK", block), ("CHUNKS", chunks), ("D", d),
                                   ("EPS_BITS", float32_bits(eps))])
    return outs[0], outs[1]


def unfused(a: Array, b: Array, weight: Array, eps: float) -> tuple[Array, Array]:
    """What `add_rms_norm` computes, as MLX's two kernels."""
    h = a + b
    return h, mx.fast.rms_norm(h, weight, eps)


checks = CheckedOnce("pymlxc's fused add + RMSNorm CUDA kernel")


def check(d: int, dtype: Any, eps: float = 1e-5) -> bool:
    """Whether the kernel runs here and equals MLX's add and rms_norm bit for bit on random rows of
    `d` with this `eps` (once per process and shape); if not, a RuntimeWarning says why."""
    return checks.verdict((str(dtype), d, float32_bits(eps)), lambda: _compare(d, dtype, eps))


def serves(weights: Sequence[Array], epsilons: Sequence[float]) -> bool:
    """Whether the kernel can stand in for every norm with these weights ([D], as the kernel takes
    them) and eps values: one width and type the kernel applies to, and its check passes for each eps."""
    kinds = {(w.shape[-1], w.dtype) for w in weights}
    if len(kinds) != 1:
        return False
    d, dtype = next(iter(kinds))
    return applies(d, dtype) and all(check(d, dtype, eps) for eps in sorted(set(map(float, epsilons))))


def _compare(d: int, dtype: Any, eps: float) -> str | None:
    rng = np.random.default_rng(0)
    a, b, w = (mx.astype(mx.array(rng.standard_normal(s).astype(np.float32)), dtype) for s in [(3, d), (3, d), (d,)])
    got, want = add_rms_norm(a, b, w, eps), unfused(a, b, w, eps)
    if all(bool(mx.array_equal(g, e).item()) for g, e in zip(got, want, strict=True)):
        return None
    return "its results differ from MLX's add and rms_norm"


__all__ = ["add_rms_norm", "applies", "check", "checks", "geometry", "serves", "unfused"]
