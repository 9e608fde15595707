"""A 4-bit quantized matrix-vector product for CUDA: `x @ dequantize(w).T` for a few rows of x.

MLX's CUDA `quantized_matmul` for one token gives each output row one warp, which reads 8 bytes of
packed weights per lane per step and accumulates in bfloat16. On an H100 the 8B shape's decode step
reads its weights at about a quarter of the memory bandwidth with it. This kernel:

* splits K over a block: a block of 128 threads takes a few output rows (two "units" of two rows),
  thread t the 16-byte chunks t, t + 128, ... (32 weights each) of every one of them, all the rows'
  loads issued together; the warps' sums meet in shared memory. Where K has 64 chunks or fewer, the
  block's two halves take two sets of units.
* multiplies in integers: each thread rounds its chunk of x to int16 (x = d * xi, d = max |x| / 32767,
  an error of 1.5e-5 of the chunk's largest value, far below the 2-byte float output's rounding)
  and takes each nibble pair's products with `dp2a` (two int16 by two int8 products a call): about
  two instructions a weight, the rounding of x shared by four rows included, where the float form
  spent about four (counted in the source, not profiled). With the affine
  layout's scale s and bias b per group,

      sum_i x_i (s q_i + b) = s d sum_i xi_i q_i + b sum_i x_i.

Measured outside MLX on an H100 (`benchmarks/profile/probe_matvec_variants.py`, CUDA graphs of calls
over weights past L2): Llama-3.1-8B's gate/up product 23.0 us against 32.6 for the float form with a
warp per two rows, down 15.2 against 21.1, q/k/v 6.6 against 9.3, a streaming read of the same
bytes 20.5, 11.4 and 6.2 us (docs/performance.md).

The layout is MLX's affine quantization (`mx.quantize(w, group_size, 4)`): `w` is uint32
(rows, K / 8) with element j of a row in bits 4 * (j % 8) of word j / 8, and `scales` / `biases`
(rows, K / group_size), so a weight is scale * q + bias.

The same kernel reads dense weights of x's 2-byte type (`dense`: chunks of 8 weights in one 16-byte
load, float products, no scales). Alone it is no faster than MLX's own matrix-vector kernel: such a
loop read them at about 2.0 against 2.1 TB/s on an H100 (commit 97ce951,
`benchmarks/profile/probe_matvec.py`; docs/performance.md). What it brings a 16-bit model is the
forms below, each a kernel fewer in the decode step (`nn.choose_dense_matvec`).

Three more forms serve the decode step (`kernel_choice.residual_product`, `normed_product`,
`normed_rope_product`): the residual form writes `residual + x @ w.T` (a block's o_proj or down_proj
and the residual add after it), the normalized form takes the residual stream h itself and first
computes MLX's RMSNorm of it in every block, into shared memory, as `add_rms_norm.py` does (the
q/k/v or paired gate/up product and the norm before it), and the RoPE form adds RoPE and the
key/value cache writes to the normalized q/k/v product. Every form sums each row in the same order,
so each gives the plain form's values bit for bit.

This module holds only the source and the launch geometry, so that the probe can run the same
kernel through MLX's own Python API; `kernel_choice.py` applies it through `pymlxc.core`.
"""
from __future__ import annotations

from typing import Any

QUANTIZED_NAME = "pymlxc_qmv4"
QUANTIZED_INPUTS = ("x", "w", "scales", "biases")
OUTPUT_NAMES = ("out",)
THREADS_PER_BLOCK = 128
UNITS_PER_GROUP = 2  # units (two output rows each) a row group of a block takes: 4 rows a thread
NORM_UNITS_PER_GROUP = 4  # the normalized forms': each block normalizes h once for 8 rows
MAX_X_ROWS = 8  # more rows of x than this go to MLX's tensor-core kernels
GROUP_SIZES = (32, 64, 128)

HEADER = r"""
namespace pymlxc_mv {

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

// The int16 rounding of x shared by the integer products here and in gguf_blocks.py's Q6_K kernel:
// xi = round(x * inv) with inv = 32767 / max |x| (`int16_inverse`, 0 for all-zero x) and the step
// d = max |x| / 32767 (`int16_step`). `int16_pair` packs two rounded values into an int, a in the
// low half (the pair `dp2a` takes with a word's bytes 0, 1 or 2, 3). The rounding goes through the
// float 1.5 * 2^23, whose low 16 bits then hold the integer (an FMA, not the slower float-to-int
// conversion).
__device__ __forceinline__ float int16_inverse(float amax) {
  return amax > 0.f ? 32767.f / amax : 0.f;
}

__device__ __forceinline__ float int16_step(float amax) {
  return amax * (1.f / 32767.f);
}

__device__ __forceinline__ int int16_pair(float a, float b, float inv) {
  const unsigned lo = __float_as_uint(fmaf(a, inv, 12582912.f));
  const unsigned hi = __float_as_uint(fmaf(b, inv, 12582912.f));
  return static_cast<int>(__byte_perm(lo, hi, 0x5410));
}

// A chunk of 32 values of x rounded to int16 (returns the step d), two to an int in the order
// `dot32` takes a word's nibbles: word j's nibbles (0, 2), (4, 6), (1, 3), (5, 7) in ints
// 4j .. 4j + 3. `xs`: the values' sum.
__device__ __forceinline__ float quantize32(const float* xf, int* xi, float& xs) {
  float amax = 0.f;
  xs = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    amax = fmaxf(amax, fabsf(xf[i]));
    xs += xf[i];
  }
  const float inv = int16_inverse(amax);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int e = 8 * j + (s & 1) * 4 + (s >> 1);  // (0, 2), (4, 6), (1, 3), (5, 7)
      xi[4 * j + s] = int16_pair(xf[e], xf[e + 2], inv);
    }
  }
  return int16_step(amax);
}

// sum_i xi_i q_i over one 16-byte chunk of packed weights (32 nibbles): a word's even nibbles are
// the bytes of word & 0x0F0F0F0F, its odd ones those of (word >> 4) & 0x0F0F0F0F.
__device__ __forceinline__ int dot32(const uint4 q, const int* xi) {
  const unsigned words[4] = {q.x, q.y, q.z, q.w};
  int s = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int lo = static_cast<int>(words[j] & 0x0F0F0F0Fu);
    const int hi = static_cast<int>((words[j] >> 4) & 0x0F0F0F0Fu);
    s = __dp2a_lo(xi[4 * j], lo, s);
    s = __dp2a_hi(xi[4 * j + 1], lo, s);
    s = __dp2a_lo(xi[4 * j + 2], hi, s);
    s = __dp2a_hi(xi[4 * j + 3], hi, s);
  }
  return s;
}

}  // namespace pymlxc_mv
"""

# The quantized kernel's header: MLX's own elementwise operations (the paired form's SiLU product),
# then the helpers above (which the GGUF block kernels share without MLX's headers).
QUANTIZED_HEADER = r"""
#include "mlx/backend/cuda/device/binary_ops.cuh"
#include "mlx/backend/cuda/device/unary_ops.cuh"

""" + HEADER[1:]

# Template arguments: T (x, scales, biases and out dtype), M (rows of x), G (group size), KC (K / 32:
# 16-byte chunks of packed weights per row), S (row groups a block has: `row_groups`), U (units a row
# group takes), PAIR (a fused gate/up weight
# [gate; up] whose product the kernel returns as silu(gate) * up, [M, N / 2]: unit j is rows j and
# j + N / 2, the same sums as unpaired, and one kernel replaces the product and MLX's
# SiLU-and-multiply kernel). N is read from the weight's shape at run time; K is a template argument
# so that each thread's loop is unrolled and its loads issued together (NVRTC compiles a template
# once per process, and MLX keeps it on disk). The normalized form adds D (x's row length, K), NB and
# NCH (MLX's rms_norm threads and 16-byte loads per thread for rows of D, at most this kernel's
# THREADS_PER_BLOCK) and EPS_BITS (eps as float32 bits: a constant, see add_rms_norm.py).
#
# A block's THREADS threads form S row groups of TPR = THREADS / S threads; row group s takes units
# unit0 + s U .. + U - 1, thread t of it chunks t, t + TPR, ... of their 2 U rows. Warp w < S U then
# stores unit unit0 + w.
_SOURCE = r"""
  constexpr int WARPS = THREADS / 32;
  constexpr int TPR = THREADS / S;  // threads along K in a row group
  constexpr int BU = S * U;
  constexpr int RB = 2 * U;
  constexpr int CHUNKS = KC;
  constexpr int K = KC * CHUNK_WEIGHTS;
//GROUPS
  constexpr int ITERS = (CHUNKS + TPR - 1) / TPR;
  const int N = w_shape[0];
  const int HALF = N / 2;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int wid = tid >> 5;
  const int t = tid % TPR;
  const int unit0 = blockIdx.x * BU;
  const int mine = unit0 + (tid / TPR) * U;  // this thread's row group's first unit
//ROWS
  const bool block_live = unit0 < UNITS;
  const uint4* wq = reinterpret_cast<const uint4*>(w);
//PROLOGUE
  if (!block_live) {
    return;
  }
  float acc[M][RB];
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int i = 0; i < RB; ++i) {
      acc[m][i] = 0.f;
    }
  }
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = it * TPR + t;
    if (CHUNKS % TPR == 0 || c < CHUNKS) {
//PRODUCT
    }
  }
  __shared__ float part[WARPS][M][RB];
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int i = 0; i < RB; ++i) {
      const float v = pymlxc_mv::warp_sum(acc[m][i]);
      if (lane == 0) {
        part[wid][m][i] = v;
      }
    }
  }
  __syncthreads();
  const int warp_id = unit0 + wid;  // the unit this warp stores
  if (wid >= BU || warp_id >= UNITS) {
    return;
  }
  // The unit's two sums per row of x, in every lane: its row group's warps in order.
  float tot[M][2];
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float v = 0.f;
#pragma unroll
      for (int k = 0; k < TPR / 32; ++k) {
        v += part[(wid / U) * (TPR / 32) + k][m][2 * (wid % U) + r];
      }
      tot[m][r] = v;
    }
  }
//STORE
#pragma unroll
  for (int m = 0; m < M; ++m) {
    T y[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      y[r] = static_cast<T>(tot[m][r]);
      if (!PAIR && lane == 0 && row0 + r < N) {
        out[static_cast<size_t>(m) * N + row0 + r] = OUT_VALUE;
      }
    }
    if (PAIR && lane == 0) {
      // silu(gate) * up as MLX's compiled kernel computes it from the two products: each operation
      // in T, with MLX's own Sigmoid and Multiply.
      T gate = y[0];
      T silu = mlx::core::cu::Multiply{}(gate, mlx::core::cu::Sigmoid{}(gate));
      out[static_cast<size_t>(m) * HALF + row0] = mlx::core::cu::Multiply{}(silu, y[1]);
    }
  }
"""

# The normalized form's prologue: x is the residual stream h, and each block first computes
# rms_norm(h) * norm into shared memory with `add_rms_norm.py`'s MLX arithmetic (its HEADER, which
# the form's header holds: NB threads of NCH 16-byte loads per row, threads past NB idle), so the
# products read bit for bit the values MLX's norm would have written. Before that, each thread asks
# L2 for its rows' first chunks of weights: the norm's round trip and the weights' then overlap.
_PROLOGUE = r"""
  __shared__ __align__(16) uint16_t xn_bits[M * D];  // T has constructors: not a __shared__ type
  T* xn = reinterpret_cast<T*>(xn_bits);
  __shared__ float partial[NB / 32];
  if (block_live && t < CHUNKS) {
#pragma unroll
    for (int i = 0; i < RB; ++i) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(wq + unit_row(min(mine + i / 2, UNITS - 1), i % 2) * CHUNKS + t));
    }
  }
  {
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


# Unit j is rows j and j + N / 2 with PAIR (the gate and up of one hidden unit), else 2j and 2j + 1;
# a row past N (the last unit's second) reads row N - 1 again, and its sum is never written.
_ROWS = r"""
  const int UNITS = PAIR ? HALF : (N + 1) / 2;
  auto unit_row = [&](int j, int r) { return static_cast<size_t>(PAIR ? j + r * HALF : min(2 * j + r, N - 1)); };
"""

_ROWS_STORE = r"""
  const int row0 = PAIR ? warp_id : 2 * warp_id;
"""

# The RoPE form's units: unit j < PAIRS is rows i and i + DH / 2 of q/k head h (j = h DH / 2 + i),
# the two values one rotation mixes; the others two adjacent value rows. N = (HQ + 2 HKV) DH.
_ROPE_ROWS = r"""
  constexpr int HALFD = DH / 2;
  constexpr int PAIRS = (HQ + HKV) * HALFD;
  const int UNITS = N / 2;
  auto unit_row = [&](int j, int r) {
    const bool rotated = j < PAIRS;
    const int first = rotated ? (j / HALFD) * DH + j % HALFD : (HQ + HKV) * DH + 2 * (j - PAIRS);
    return static_cast<size_t>(first + r * (rotated ? HALFD : 1));
  };
"""

# The RoPE form's stores: the products rounded to T as the plain form writes them, then RoPE as
# `rope_kv.py`'s kernel computes it from those values (its `pymlxc_rope` device functions, which the
# form's header holds: `kernel_choice`): queries to
# `out` [M, HQ, 1, DH], the key into `kcache` and the value into `vcache` at slot pos[0], in place.
_ROPE_STORE = r"""
  const bool rot = warp_id < PAIRS;
  const int head = warp_id / HALFD;
  const int ii = warp_id % HALFD;
  const int p = pos[0];
  float costheta = 0.f;
  float sintheta = 0.f;
  if (rot) {
    pymlxc_rope::angle<FREQS>(rope, ii, HALFD, p, __int_as_float(SCALE_BITS), __int_as_float(LOG2_BASE_BITS),
                              costheta, sintheta);
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    T y[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      y[r] = static_cast<T>(tot[m][r]);
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


# The 4-bit product of a chunk (32 weights in one 16-byte load per row) with x's values there.
_QUANTIZED_PRODUCT = r"""
      const int g = (c * 32) / G;
      uint4 q[RB];
      float sc[RB];
      float bi[RB];
#pragma unroll
      for (int i = 0; i < RB; ++i) {
        const size_t row = unit_row(min(mine + i / 2, UNITS - 1), i % 2);
        q[i] = wq[row * CHUNKS + c];
        sc[i] = static_cast<float>(scales[row * GROUPS + g]);
        bi[i] = static_cast<float>(biases[row * GROUPS + g]);
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float xf[32];
        const T* xp = X_ROWS + static_cast<size_t>(m) * K + c * 32;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          pymlxc_mv::load8(xp + 8 * j, xf + 8 * j);
        }
        int xi[16];
        float xs;
        const float d = pymlxc_mv::quantize32(xf, xi, xs);
#pragma unroll
        for (int i = 0; i < RB; ++i) {
          acc[m][i] += sc[i] * d * static_cast<float>(pymlxc_mv::dot32(q[i], xi)) + bi[i] * xs;
        }
      }
"""

# The dense product of a chunk: 8 weights of x's type in one 16-byte load per row, each row's 8
# products summed in float in order, then added to the row's sum.
_DENSE_PRODUCT = r"""
      uint4 q[RB];
#pragma unroll
      for (int i = 0; i < RB; ++i) {
        q[i] = wq[unit_row(min(mine + i / 2, UNITS - 1), i % 2) * CHUNKS + c];
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float xf[8];
        pymlxc_mv::load8(X_ROWS + static_cast<size_t>(m) * K + c * 8, xf);
#pragma unroll
        for (int i = 0; i < RB; ++i) {
          float wf[8];
          pymlxc_mv::load8(reinterpret_cast<const T*>(&q[i]), wf);
          float s = 0.f;
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            s = fmaf(wf[e], xf[e], s);
          }
          acc[m][i] += s;
        }
      }
"""


def _source(form: str, dense: bool = False) -> str:
    """The kernel's body in one of its forms: "plain" (out = x @ w.T), "residual" (out = residual +
    x @ w.T), "norm" (out = (rms_norm(x) * norm) @ w.T) or "rope" (the normalized q/k/v product with
    RoPE and the key/value writes of `rope_kv.py`'s kernel after it); of 4-bit weights, or with
    `dense` of weights in x's 2-byte type (chunks of 8 weights instead of 32, no scales)."""
    normed = form in ("norm", "rope")
    head, store = _SOURCE.split("//STORE\n")
    body = head + (_ROPE_STORE.lstrip("\n") if form == "rope" else _ROWS_STORE.lstrip("\n") + store)
    return (body.replace("THREADS", str(THREADS_PER_BLOCK))
            .replace("CHUNK_WEIGHTS", str(DENSE_CHUNK if dense else 32))
            .replace("//GROUPS\n", "" if dense else "  constexpr int GROUPS = K / G;\n")
            .replace("//PRODUCT\n", (_DENSE_PRODUCT if dense else _QUANTIZED_PRODUCT).lstrip("\n"))
            .replace("//ROWS\n", (_ROPE_ROWS if form == "rope" else _ROWS).lstrip("\n"))
            .replace("//PROLOGUE\n", _PROLOGUE.lstrip("\n") if normed else "")
            .replace("X_ROWS", "xn" if normed else "x")
            # the residual read in T and added as MLX's add (and `kernels/add_rms_norm.py`) takes it
            .replace("OUT_VALUE", "residual[static_cast<size_t>(m) * N + row0 + r] + y[r]" if form == "residual"
                     else "y[r]"))


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
# The same kernel and forms over dense weights of x's type (a 16-bit model's block linears): the
# forms' point there is the kernels they save a decode step (the adds, norms and SiLU products),
# not the product's own speed (see the module's docstring).
DENSE_CHUNK = 8  # weights of a dense chunk: one 16-byte load of 2-byte floats
DENSE_INPUTS = ("x", "w")
DENSE_NAME = "pymlxc_mv16"
DENSE_SOURCE = _source("plain", dense=True)
DENSE_RESIDUAL_NAME = "pymlxc_mv16_residual"
DENSE_RESIDUAL_INPUTS = (*DENSE_INPUTS, "residual")
DENSE_RESIDUAL_SOURCE = _source("residual", dense=True)
DENSE_NORM_NAME = "pymlxc_mv16_norm"
DENSE_NORM_INPUTS = (*DENSE_INPUTS, "norm")
DENSE_NORM_SOURCE = _source("norm", dense=True)
DENSE_ROPE_NAME = "pymlxc_mv16_norm_rope"
DENSE_ROPE_INPUTS = (*DENSE_NORM_INPUTS, "pos", "rope", "kcache", "vcache")
DENSE_ROPE_SOURCE = _source("rope", dense=True)
# The normalized form keeps M rows of normalized x in shared memory: 32 KB at most. (Blocks of 512
# threads, a quarter as many norms, decoded Llama-3.1-8B slower on an H200: docs/performance.md.)
NORM_MAX_BYTES = 32768


def quantized_applies(x_rows: int, k: int, bits: int, group_size: int, dtype_size: int) -> bool:
    """Whether the quantized kernel computes the product: 4-bit weights, 2-byte floats, a few rows of x."""
    return (bits == 4 and group_size in GROUP_SIZES and dtype_size == 2 and 1 <= x_rows <= MAX_X_ROWS
            and k % 32 == 0 and k % group_size == 0)


def dense_applies(x_rows: int, k: int, dtype_size: int) -> bool:
    """Whether the dense kernel computes the product: weights and x of one 2-byte float type, a few rows of x."""
    return dtype_size == 2 and 1 <= x_rows <= MAX_X_ROWS and k % DENSE_CHUNK == 0


def norm_applies(x_rows: int, k: int, dtype_size: int, norm_threads: int) -> bool:
    """Whether the normalized form takes x (x_rows, k): its normalized rows fit the shared memory and
    MLX's norm for rows of k runs on no more threads than a block of this kernel has."""
    return x_rows * k * dtype_size <= NORM_MAX_BYTES and norm_threads <= THREADS_PER_BLOCK


def row_groups(k: int, dense: bool = False) -> int:
    """Row groups of a block for rows of x of length k (the kernel's template argument S): two where
    a row has at most 64 chunks (each group's 64 threads then span it), else one of all
    THREADS_PER_BLOCK threads."""
    return 2 if k // (DENSE_CHUNK if dense else 32) <= 64 else 1


def units_per_block(k: int, norm: bool = False, dense: bool = False) -> int:
    """Units (two output rows each) one block takes for rows of x of length k: its row groups times
    the units each takes (more for the normalized forms, which normalize h once a block)."""
    groups = row_groups(k, dense)
    return groups * (NORM_UNITS_PER_GROUP if norm and groups == 1 else UNITS_PER_GROUP)


def launch(x_rows: int, k: int, n: int, dtype: Any, group_size: int, pair: bool = False,
           norm: tuple[int, int, int] | None = None, dense: bool = False) -> dict[str, Any]:
    """Keyword arguments of a kernel call for x (x_rows, k) and weights of n rows: grid, threads,
    template. `pair`: the gate/up form (n even; output n / 2 per row of x). `norm`: the normalized
    form's (threads, loads per thread, eps as float32 bits) of MLX's rms_norm over rows of k.
    `dense`: the dense kernel's (weights of x's type; `group_size` unused)."""
    units = n // 2 if pair else -(-n // 2)
    groups, per_block = row_groups(k, dense), units_per_block(k, norm is not None, dense)
    template: list[tuple[str, Any]] = [("T", dtype), ("M", x_rows)]
    if not dense:
        template.append(("G", group_size))
    template += [("KC", k // (DENSE_CHUNK if dense else 32)), ("S", groups), ("U", per_block // groups),
                 ("PAIR", pair)]
    if norm is not None:
        threads, loads, eps_bits = norm
        template += [("D", k), ("NB", threads), ("NCH", loads), ("EPS_BITS", eps_bits)]
    blocks = -(-units // per_block)
    return {"grid": (blocks * THREADS_PER_BLOCK, 1, 1), "threadgroup": (THREADS_PER_BLOCK, 1, 1), "template": template}
