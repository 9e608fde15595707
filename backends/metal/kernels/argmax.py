"""Greedy sampling's argmax over a vocabulary as two CUDA kernels, for the decode segments.

MLX reduces a row to its argmax with one block of 1024 threads, whatever the row's length: on an
H100 that single block takes 26.6 us for Llama's 128256 logits (Nsight Compute; docs/performance.md), one of
a decode step's costliest kernels, and a cast to int32 follows it. Here many blocks each reduce a
slice of the row to (value, index), then one block reduces those pairs and writes the int32 index.

The result is MLX's exactly, by construction: both take the largest value and, among equal values,
the smallest index (each thread scans its indices in increasing order keeping a strictly larger
value; partial results merge by value, then by the smaller index). NaN counts as the largest value
(the first NaN wins, as MLX's argmax gives on its CPU and CUDA backends), and a row with no value
above -inf gives index 0, as MLX's reduction starts from (index 0, -inf). `check()` still
compares it with MLX's argmax once per process (ties included) and keeps MLX's where any index
differs or the kernel cannot run.

This module holds the source and the launch; `segments.py` decides where to use it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core.cuda_kernel import SharedKernel

from .check import CheckedOnce

THREADS = 256  # per block, both stages
MAX_SLICES = 128  # blocks per row in the first stage

# Template arguments: T (the logits' type), V (row length), SLICES (blocks per row). Grid: SLICES
# blocks across, one row per block row.
PARTIAL_SOURCE = r"""
  __shared__ float best_v[THREADS];
  __shared__ int best_i[THREADS];
  const int tid = threadIdx.x;
  const size_t row = blockIdx.y;
  const int per = (V + SLICES - 1) / SLICES;
  const int start = blockIdx.x * per;
  const int stop = min(start + per, V);
  const T* x = logits + row * V;
  float v = -INFINITY;
  int at = 0;
  for (int i = start + tid; i < stop; i += THREADS) {
    float y = static_cast<float>(x[i]);
    if (pymlxc_beats(y, i, v, at)) { v = y; at = i; }
  }
  best_v[tid] = v;
  best_i[tid] = at;
  pymlxc_reduce_block(best_v, best_i, tid);
  if (tid == 0) {
    values[row * SLICES + blockIdx.x] = best_v[0];
    indices[row * SLICES + blockIdx.x] = best_i[0];
  }
"""

# Template argument: SLICES. One block per row.
FINAL_SOURCE = r"""
  __shared__ float best_v[THREADS];
  __shared__ int best_i[THREADS];
  const int tid = threadIdx.x;
  const size_t row = blockIdx.x;
  float v = -INFINITY;
  int at = 0;
  for (int i = tid; i < SLICES; i += THREADS) {
    float ov = values[row * SLICES + i];
    int oi = indices[row * SLICES + i];
    if (pymlxc_beats(ov, oi, v, at)) { v = ov; at = oi; }
  }
  best_v[tid] = v;
  best_i[tid] = at;
  pymlxc_reduce_block(best_v, best_i, tid);
  if (tid == 0) {
    out[row] = best_i[0];
  }
"""

# Whether (v, i) goes before (w, j): NaN above every number (the first NaN wins), then the larger
# value, then the smaller index. MLX's argmax orders NaN so (seen on its CPU and CUDA backends).
HEADER = f"#define THREADS {THREADS}\n" + r"""
__device__ __forceinline__ bool pymlxc_beats(float v, int i, float w, int j) {
  const bool vn = isnan(v), wn = isnan(w);
  if (vn || wn) {
    return vn && (!wn || i < j);
  }
  return v > w || (v == w && i < j);
}

// The block's (value, index) pairs in shared memory, reduced into element 0 in that order.
__device__ __forceinline__ void pymlxc_reduce_block(float* best_v, int* best_i, int tid) {
  __syncthreads();
  for (int s = THREADS / 2; s > 0; s >>= 1) {
    if (tid < s && pymlxc_beats(best_v[tid + s], best_i[tid + s], best_v[tid], best_i[tid])) {
      best_v[tid] = best_v[tid + s];
      best_i[tid] = best_i[tid + s];
    }
    __syncthreads();
  }
}
"""

_partial = SharedKernel("pymlxc_argmax_partial", ("logits",), ("values", "indices"), PARTIAL_SOURCE,
                        header=HEADER)
_final = SharedKernel("pymlxc_argmax_final", ("values", "indices"), ("out",), FINAL_SOURCE, header=HEADER)

FLOAT_TYPES = ("bfloat16", "float16", "float32")


def applies(dtype: Any) -> bool:
    """Whether the kernels take logits of `dtype` (floating types)."""
    return str(dtype).rsplit(".", 1)[-1] in FLOAT_TYPES


def slices(v: int) -> int:
    """First-stage blocks per row: about 1024 logits each, at most MAX_SLICES."""
    return max(1, min(MAX_SLICES, -(-v // 1024)))


def argmax(logits: Array) -> Array:
    """int32 [B]: the index of each row's largest logit (the first among equal ones), for logits
    [B, V] of a floating type (`applies`)."""
    b, v = logits.shape
    n = slices(v)
    values, indices = _partial()([logits], output_shapes=[(b, n), (b, n)], output_dtypes=[mx.float32, mx.int32],
                                 grid=(n * THREADS, b, 1), threadgroup=(THREADS, 1, 1),
                                 template=[("T", logits.dtype), ("V", v), ("SLICES", n)])
    (out,) = _final()([values, indices], output_shapes=[(b,)], output_dtypes=[mx.int32],
                      grid=(b * THREADS, 1, 1), threadgroup=(THREADS, 1, 1), template=[("SLICES", n)])
    return out


checks = CheckedOnce("the CUDA argmax kernel")


def check(v: int, dtype: Any) -> bool:
    """Whether the kernels run here and give MLX's argmax on random rows of `v` logits of `dtype`,
    with ties placed across slices (once per process and shape); if not, a RuntimeWarning says why."""
    return checks.verdict((v, str(dtype)), lambda: _compare(v, dtype))


def _compare(v: int, dtype: Any) -> str | None:
    rng = np.random.default_rng(0)
    rows = rng.normal(0, 4, (6, v)).astype(np.float32)
    top = float(rows.max()) + 1.0
    rows[1, [v - 1, v // 2, 3]] = top  # one maximum thrice: the first index must win
    rows[2, :] = top  # all equal
    rows[3, [v - 1]] = top  # the maximum at the end
    rows[4, :] = -np.inf  # no value above -inf: index 0
    rows[5, [v // 3, v - 1]] = np.nan  # the first NaN wins
    logits = mx.array(rows).astype(dtype)
    got = np.asarray(argmax(logits))
    want = np.asarray(mx.argmax(logits, axis=-1).astype(mx.int32))
    if not np.array_equal(got, want):
        return f"it differs from MLX's argmax for {v} {dtype} logits ({got.tolist()} against {want.tolist()})"
    return None


__all__ = ["applies", "argmax", "check", "checks", "slices"]
