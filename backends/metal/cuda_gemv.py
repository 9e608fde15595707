"""A dense (2-byte float) matrix-vector product for CUDA with one thread block per few output rows.

MLX's CUDA `gemv_single` gives each output row one warp that walks the row in 8-byte steps. On an
H100 that reads Llama-3.2-1B's down projection (2048 rows of 8192) at about 1.8 TB/s and its q/k/v
projection at 1.6 (Nsight Compute, `benchmarks/h100/session7/ncu`), against about 2.9 TB/s that the
device reads a flat buffer at. Here a block of THREADS threads splits a row's K: each thread loads
its 16-byte chunks of ROWS rows at once (all loads in flight before any arithmetic), a block reads
each row as one contiguous run, and the block sums in float32 through shared memory.

This module holds the source and the launch geometry.
"""
from __future__ import annotations

from typing import Any

NAME = "pymlxc_gemv"
INPUTS = ("x", "w")
OUTPUTS = ("out",)

# Template arguments: T (2-byte float), K, N, THREADS (per block, a multiple of 32), ROWS (per block).
# K is a multiple of 8 * THREADS: each thread reads PER 16-byte chunks of each of its rows.
SOURCE = r"""
  constexpr int PER = K / (8 * THREADS);
  constexpr int WARPS = THREADS / 32;
  __shared__ float partial[ROWS][WARPS];
  const int t = threadIdx.x;
  const size_t row0 = static_cast<size_t>(blockIdx.x) * ROWS;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  uint4 wv[ROWS][PER];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const size_t row = row0 + r < N ? row0 + r : N - 1;
#pragma unroll
    for (int c = 0; c < PER; ++c) {
      wv[r][c] = w4[row * (K / 8) + c * THREADS + t];
    }
  }
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = 0.f;
  }
#pragma unroll
  for (int c = 0; c < PER; ++c) {
    uint4 xv = x4[c * THREADS + t];
    const T* xe = reinterpret_cast<const T*>(&xv);
    float xf[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      xf[j] = static_cast<float>(xe[j]);
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const T* we = reinterpret_cast<const T*>(&wv[r][c]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc[r] = fmaf(xf[j], static_cast<float>(we[j]), acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float v = acc[r];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      v += __shfl_xor_sync(0xffffffffu, v, off);
    }
    if ((t & 31) == 0) {
      partial[r][t >> 5] = v;
    }
  }
  __syncthreads();
  if (t < 32) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float v = t < WARPS ? partial[r][t] : 0.f;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, off);
      }
      if (t == 0 && row0 + r < N) {
        out[row0 + r] = static_cast<T>(v);
      }
    }
  }
"""


def threads_for(k: int) -> int | None:
    """Threads per block for rows of k: the most (up to 256) that split k into whole 16-byte
    chunks, at most 8 per thread per row; None where none does."""
    for threads in (256, 128, 64, 32):
        if k % (8 * threads) == 0 and k // (8 * threads) <= 8:
            return threads
    return None


def launch(k: int, n: int, dtype: Any, rows: int, threads: int) -> dict[str, Any]:
    blocks = -(-n // rows)
    return {"grid": (blocks * threads, 1, 1), "threadgroup": (threads, 1, 1),
            "template": [("T", dtype), ("K", k), ("N", n), ("THREADS", threads), ("ROWS", rows)]}
