"""A 4-bit quantized matrix-vector product for CUDA: `x @ dequantize(w).T` for a few rows of x.

MLX's CUDA `quantized_matmul` for one token gives each output row one warp, which reads 8 bytes of
packed weights per lane per step and accumulates in bfloat16. On an H100 the 8B shape's decode step
reads its weights at about a quarter of the memory bandwidth with it. This kernel reads 16 bytes
per lane per step (32 weights), keeps `ROWS_PER_WARP` output rows per warp so each load of x serves several
rows, accumulates in float32, and turns nibbles into floats without the slow integer conversion:
a nibble q placed in the mantissa of 1.0 is the float 1 + q/16, so

    sum_i x_i * q_i = 16 * (sum_i x_i * (1 + q_i / 16) - sum_i x_i).

The layout is MLX's affine quantization (`mx.quantize(w, group_size, 4)`): `w` is uint32
(rows, K / 8) with element j of a row in bits 4 * (j % 8) of word j / 8, and `scales` / `biases`
(rows, K / group_size), so a weight is scale * q + bias.

Dense (bfloat16) weights stay with MLX: the same loop over 16-byte chunks of 8 weights read them no
faster than MLX's own matrix-vector kernel, about 2.0 against 2.1 TB/s on an H100 (commit 97ce951,
`benchmarks/profile/probe_matvec.py`; docs/performance.md).

Two more forms serve the decode step (`kernel_choice.residual_product`, `normed_product`): the
residual form writes `residual + x @ w.T` (a block's o_proj or down_proj and the residual add after
it), and the normalized form takes the residual stream h itself and first computes MLX's RMSNorm of
it in every block, into shared memory, as `add_rms_norm.py` does (the q/k/v or paired gate/up
product and the norm before it). Two kernels fewer per layer, for the same bits.

This module holds only the source and the launch geometry, so that the probe can run the same
kernel through MLX's own Python API; `kernel_choice.py` applies it through `pymlxc.core`.
"""
from __future__ import annotations

from typing import Any

QUANTIZED_NAME = "pymlxc_qmv4"
QUANTIZED_INPUTS = ("x", "w", "scales", "biases")
OUTPUT_NAMES = ("out",)
THREADS_PER_BLOCK = 128
ROWS_PER_WARP = 2
MAX_X_ROWS = 8  # more rows of x than this go to MLX's tensor-core kernels
GROUP_SIZES = (32, 64, 128)

HEADER = r"""
namespace pymlxc_mv {

// sum_i x[i] * (1 + q_i / 16) over the 8 nibbles of a word (nibble i in bits 4i..4i+3).
__device__ __forceinline__ float biased_dot8(uint32_t word, const float* x) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint32_t placed = (i <= 4) ? (word << (19 - 4 * i)) : (word >> (4 * i - 19));
    s = fmaf(x[i], __uint_as_float((placed & 0x00780000u) | 0x3F800000u), s);
  }
  return s;
}

// Eight 2-byte floats (bfloat16 or float16) from one 16-byte load.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* f) {
  uint4 u = *reinterpret_cast<const uint4*>(p);
  const T* h = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    f[i] = static_cast<float>(h[i]);
  }
}

// The sum of v over the warp's 32 lanes, in every lane (the same butterfly order in each kernel).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, off);
  }
  return v;
}

}  // namespace pymlxc_mv
"""

# The quantized kernel's header: MLX's own elementwise operations (the paired form's SiLU product),
# then the helpers above (which the GGUF block kernels share without MLX's headers).
QUANTIZED_HEADER = r"""
#include "mlx/backend/cuda/device/binary_ops.cuh"
#include "mlx/backend/cuda/device/unary_ops.cuh"

""" + HEADER[1:]

# Template arguments: T (x, scales, biases and out dtype), M (rows of x), G (group size), R (output
# rows per warp), PAIR (a fused gate/up weight [gate; up] whose product the kernel returns as
# silu(gate) * up, [M, N / 2]: warp j computes rows j and j + N / 2, the same sums as unpaired, and
# one kernel replaces the product and MLX's SiLU-and-multiply kernel). The weight's sizes are read
# from its shape at run time, so that a model's linears share one compiled kernel per row count of x:
# NVRTC compiles each template once per process. The normalized form adds D (x's row length, K),
# NB and NCH (MLX's rms_norm threads and 16-byte loads per thread for rows of D, at most this
# kernel's THREADS_PER_BLOCK) and EPS_BITS (eps as float32 bits: a constant, see add_rms_norm.py).
_SOURCE = r"""
  const int N = w_shape[0];
  const int CHUNKS = w_shape[1] / 4;  // 16-byte chunks of packed weights per row
  const int K = CHUNKS * 32;
  const int GROUPS = K / G;
  const int ITERS = (CHUNKS + 31) / 32;
  const int lane = threadIdx.x & 31;
  const int HALF = N / 2;
  const int warp_id = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
//ROWS
//PROLOGUE
  if (!live) {
    return;
  }
//RESIDUAL
  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      acc[m][r] = 0.f;
    }
  }
  const uint4* wq = reinterpret_cast<const uint4*>(w);
#pragma unroll 2
  for (int it = 0; it < ITERS; ++it) {
    const int c = it * 32 + lane;
    if (c >= CHUNKS) {
      break;
    }
    const int g = (c * 32) / G;
    uint4 q[R];
    float sc[R];
    float bi[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const size_t row = row_of(r);
      q[r] = wq[row * CHUNKS + c];
      sc[r] = static_cast<float>(scales[row * GROUPS + g]);
      bi[r] = static_cast<float>(biases[row * GROUPS + g]);
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float xf[32];
      const T* xp = X_ROWS + static_cast<size_t>(m) * K + c * 32;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        pymlxc_mv::load8(xp + 8 * j, xf + 8 * j);
      }
      float xs = 0.f;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        xs += xf[i];
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float d = pymlxc_mv::biased_dot8(q[r].x, xf) + pymlxc_mv::biased_dot8(q[r].y, xf + 8) +
                  pymlxc_mv::biased_dot8(q[r].z, xf + 16) + pymlxc_mv::biased_dot8(q[r].w, xf + 24);
        acc[m][r] += 16.f * sc[r] * d + (bi[r] - 16.f * sc[r]) * xs;
      }
    }
  }
//STORE
#pragma unroll
  for (int m = 0; m < M; ++m) {
    T y[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      y[r] = static_cast<T>(pymlxc_mv::warp_sum(acc[m][r]));
      if (!PAIR && lane == 0 && row0 + r < N) {
        out[static_cast<size_t>(m) * N + row0 + r] = OUT_VALUE;
      }
    }
    if (PAIR && lane == 0) {
      // silu(gate) * up as MLX's compiled kernel computes it from the two products: each operation
      // in T, with MLX's own Sigmoid and Multiply.
      T gate = y[0];
      T silu = mlx::core::cu::Multiply{}(gate, mlx::core::cu::Sigmoid{}(gate));
      out[static_cast<size_t>(m) * HALF + row0] = mlx::core::cu::Multiply{}(silu, y[R - 1]);
    }
  }
"""

# The residual form's additions: each output is residual + the product, the sum in T as MLX's add
# (and `kernels/add_rms_norm.py`) takes it; lane 0 reads its rows' residuals first, so that the
# read is not a round trip at the end.
_RESIDUAL = r"""
  T res[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      res[m][r] = (lane == 0 && row0 + r < N) ? residual[static_cast<size_t>(m) * N + row0 + r] : T(0.f);
    }
  }
"""

# The normalized form's prologue: x is the residual stream h, and each block first computes
# rms_norm(h) * norm into shared memory with `add_rms_norm.py`'s MLX arithmetic (its HEADER, which
# the form's header holds: NB threads of NCH 16-byte loads per row, threads past NB idle), so the
# products read bit for bit the values MLX's norm would have written. Before that, each lane asks
# L2 for its rows' first chunks of weights: the norm's round trip and the weights' then overlap.
_PROLOGUE = r"""
  __shared__ __align__(16) uint16_t xn_bits[M * D];  // T has constructors: not a __shared__ type
  T* xn = reinterpret_cast<T*>(xn_bits);
  __shared__ float partial[NB / 32];
  if (live && lane < CHUNKS) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const uint4*>(w) + row_of(r) * CHUNKS + lane));
    }
  }
  {
    const int tid = threadIdx.x;
    const uint4* w4 = reinterpret_cast<const uint4*>(norm);
#pragma unroll 1
    for (int m = 0; m < M; ++m) {
      const uint4* h4 = reinterpret_cast<const uint4*>(x + static_cast<size_t>(m) * D);
      uint4* xn4 = reinterpret_cast<uint4*>(xn + static_cast<size_t>(m) * D);
      uint4 hv4[NCH];
      uint4 wv4[NCH];
#pragma unroll
      for (int i = 0; i < NCH; ++i) {
        if (tid < NB && NB * i + tid < D / 8) {
          hv4[i] = h4[NB * i + tid];
          wv4[i] = w4[NB * i + tid];
        }
      }
      const float inv = pymlxc_rms::inverse_rms<T, NB, NCH, D>(hv4, partial, __int_as_float(EPS_BITS));
#pragma unroll
      for (int i = 0; i < NCH; ++i) {
        if (tid < NB && NB * i + tid < D / 8) {
          pymlxc_rms::scale_vector<T>(hv4[i], wv4[i], inv);
          xn4[NB * i + tid] = hv4[i];
        }
      }
      __syncthreads();  // xn is whole, and `partial` free for the next row
    }
  }
"""


_ROWS = r"""
  // PAIR: warp j takes rows j and j + N / 2 (gate and up of one hidden unit, R = 2).
  const int row0 = PAIR ? warp_id : warp_id * R;
  const bool live = row0 < (PAIR ? HALF : N);
  // Rows past N (the last warp's) read row N - 1 again; their sums are never written.
  auto row_of = [&](int r) { return static_cast<size_t>(PAIR ? row0 + r * HALF : min(row0 + r, N - 1)); };
"""

# The RoPE form's rows: warp j < PAIRS takes rows i and i + DH / 2 of q/k head h (j = h DH / 2 + i),
# the two values one rotation mixes; the others take two adjacent value rows. N = (HQ + 2 HKV) DH.
_ROPE_ROWS = r"""
  constexpr int HALFD = DH / 2;
  constexpr int PAIRS = (HQ + HKV) * HALFD;
  const bool rot = warp_id < PAIRS;
  const int head = warp_id / HALFD;
  const int ii = warp_id % HALFD;
  const int row0 = rot ? head * DH + ii : (HQ + HKV) * DH + 2 * (warp_id - PAIRS);
  const int row_step = rot ? HALFD : 1;
  const bool live = warp_id < N / 2;
  auto row_of = [&](int r) { return static_cast<size_t>(row0 + r * row_step); };
"""

# The RoPE form's stores: the products rounded to T as the plain form writes them, then RoPE as
# `rope_kv.py`'s kernel computes it from those values (its `pymlxc_rope` device functions, which the
# form's header holds: `kernel_choice`): queries to
# `out` [M, HQ, 1, DH], the key into `kcache` and the value into `vcache` at slot pos[0], in place.
_ROPE_STORE = r"""
  const int p = pos[0];
  float costheta = 0.f;
  float sintheta = 0.f;
  if (rot) {
    pymlxc_rope::angle<FREQS>(rope, ii, HALFD, p, __int_as_float(SCALE_BITS), __int_as_float(LOG2_BASE_BITS),
                              costheta, sintheta);
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    T y[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      y[r] = static_cast<T>(pymlxc_mv::warp_sum(acc[m][r]));
    }
    if (lane == 0) {
      if (rot) {
        float x1 = static_cast<float>(y[0]);
        float x2 = static_cast<float>(y[1]);
        float rx1, rx2;
        pymlxc_rope::rotate(x1, x2, costheta, sintheta, rx1, rx2);
        if (head < HQ) {
          T* dst = out + (static_cast<int64_t>(m) * HQ + head) * DH;
          dst[ii] = static_cast<T>(rx1);
          dst[ii + HALFD] = static_cast<T>(rx2);
        } else {
          T* dst = const_cast<T*>(kcache) + m * kcache_strides[0] + (head - HQ) * kcache_strides[1]
              + static_cast<int64_t>(p) * kcache_strides[2];
          dst[ii * kcache_strides[3]] = static_cast<T>(rx1);
          dst[(ii + HALFD) * kcache_strides[3]] = static_cast<T>(rx2);
        }
      } else {
        const int j = 2 * (warp_id - PAIRS);
        T* dst = const_cast<T*>(vcache) + m * vcache_strides[0] + (j / DH) * vcache_strides[1]
            + static_cast<int64_t>(p) * vcache_strides[2];
        dst[(j % DH) * vcache_strides[3]] = y[0];
        dst[(j % DH + 1) * vcache_strides[3]] = y[1];
      }
    }
  }
"""


def _source(form: str) -> str:
    """The kernel's body in one of its forms: "plain" (out = x @ w.T), "residual" (out = residual +
    x @ w.T), "norm" (out = (rms_norm(x) * norm) @ w.T) or "rope" (the normalized q/k/v product with
    RoPE and the key/value writes of `rope_kv.py`'s kernel after it)."""
    normed = form in ("norm", "rope")
    head, store = _SOURCE.split("//STORE\n")
    body = head + (_ROPE_STORE.lstrip("\n") if form == "rope" else store)
    return (body.replace("//ROWS\n", (_ROPE_ROWS if form == "rope" else _ROWS).lstrip("\n"))
            .replace("//PROLOGUE\n", _PROLOGUE.lstrip("\n") if normed else "")
            .replace("//RESIDUAL\n", _RESIDUAL.lstrip("\n") if form == "residual" else "")
            .replace("X_ROWS", "xn" if normed else "x")
            .replace("OUT_VALUE", "res[m][r] + y[r]" if form == "residual" else "y[r]"))


QUANTIZED_SOURCE = _source("plain")
# The forms with an epilogue and a prologue (the decode step's residual adds and RMSNorms inside the
# products: `kernel_choice.residual_product` and `normed_product`): one more input each.
RESIDUAL_NAME = "pymlxc_qmv4_residual"
RESIDUAL_INPUTS = (*QUANTIZED_INPUTS, "residual")
RESIDUAL_SOURCE = _source("residual")
NORM_NAME = "pymlxc_qmv4_norm"
NORM_INPUTS = (*QUANTIZED_INPUTS, "norm")
NORM_SOURCE = _source("norm")  # its header: `add_rms_norm.HEADER` before QUANTIZED_HEADER
ROPE_NAME = "pymlxc_qmv4_norm_rope"
ROPE_INPUTS = (*NORM_INPUTS, "pos", "rope", "kcache", "vcache")
ROPE_SOURCE = _source("rope")  # the normalized form's header
# The normalized form keeps M rows of normalized x in shared memory: 32 KB at most. (Blocks of 512
# threads, a quarter as many norms, decoded Llama-3.1-8B slower on an H200: docs/performance.md.)
NORM_MAX_BYTES = 32768


def quantized_applies(x_rows: int, k: int, bits: int, group_size: int, dtype_size: int) -> bool:
    """Whether the quantized kernel computes the product: 4-bit weights, 2-byte floats, a few rows of x."""
    return (bits == 4 and group_size in GROUP_SIZES and dtype_size == 2 and 1 <= x_rows <= MAX_X_ROWS
            and k % 32 == 0 and k % group_size == 0)


def norm_applies(x_rows: int, k: int, dtype_size: int, norm_threads: int) -> bool:
    """Whether the normalized form takes x (x_rows, k): its normalized rows fit the shared memory and
    MLX's norm for rows of k runs on no more threads than a block of this kernel has."""
    return x_rows * k * dtype_size <= NORM_MAX_BYTES and norm_threads <= THREADS_PER_BLOCK


def launch(x_rows: int, k: int, n: int, dtype: Any, group_size: int,
           rows_per_warp: int = ROWS_PER_WARP, pair: bool = False,
           norm: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """Keyword arguments of a kernel call for x (x_rows, k) and weights of n rows: grid, threads,
    template. `pair`: the gate/up form (n even; output n / 2 per row of x). `norm`: the normalized
    form's (threads, loads per thread, eps as float32 bits) of MLX's rms_norm over rows of k."""
    warps = n // 2 if pair else -(-n // rows_per_warp)
    template: list[tuple[str, Any]] = [("T", dtype), ("M", x_rows), ("G", group_size),
                                       ("R", 2 if pair else rows_per_warp), ("PAIR", pair)]
    if norm is not None:
        threads, loads, eps_bits = norm
        template += [("D", k), ("NB", threads), ("NCH", loads), ("EPS_BITS", eps_bits)]
    return {"grid": (warps * 32, 1, 1), "threadgroup": (THREADS_PER_BLOCK, 1, 1), "template": template}
