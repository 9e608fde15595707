"""Kernels that read llama.cpp's Q2_K, Q3_K and Q6_K blocks as they lie in the file, for
`gguf_layers.BlockLinear` and friends: a matrix-vector product for a few rows of x (decode) and a
dequantization of whole rows (prefill: chunks of rows dequantized, then MLX's matmul).

Without them a block layer dequantizes its whole matrix with MLX ops at every call (a Q6_K output
head of 128k x 2048 is a 1 GiB float32 temporary per token). The weight stays uint8
[rows, blocks, bytes], llama.cpp's `block_q6_K` & co. one after another (84 / 110 / 210 bytes per
256 weights), so reading it directly costs the file's 2.6 / 3.4 / 6.6 bits per weight.

Layout (ggml-common.h), value p of a 256-value block, with n = p / 128, k = (p % 128) / 32,
l = p % 32 and s = p / 16 (the 16-value sub-block):

    Q6_K  ql[128] qh[64] sc[16] (int8) d      w = d sc[s] (q - 32),
          q = (ql[64n + 32(k & 1) + l] >> 4(k >> 1)) & 15 | ((qh[32n + l] >> 2k) & 3) << 4
    Q3_K  hmask[32] qs[64] scales[12] d       w = d (sc[s] - 32) (q - (hmask bit p/32 of byte l ? 0 : 4)),
          q = (qs[32n + l] >> 2k) & 3, sc 6-bit: low nibble from scales[s % 8] (>> 4 for s >= 8),
          high 2 bits from scales[8 + s % 4] >> 2(s / 4)
    Q2_K  scales[16] qs[64] d dmin            w = d (scales[s] & 15) q - dmin (scales[s] >> 4),
          q = (qs[32n + l] >> 2k) & 3

In the matvec, each lane of a warp (CUDA) or simdgroup (Metal) takes 8 consecutive values of a block
(one sub-block half, one scale), so a warp covers one block per step (Q6_K on CUDA has a kernel of
its own, `CUDA_Q6K_MATVEC_SOURCE`, which reads 4 blocks a step); it accumulates x . w in float32
for `R` output rows at once (each x load serves them), and the lanes' sums are reduced with
shuffles / `simd_sum`. The values are computed with the reference's float32 operations in its
order (rounding each product: `__fmul_rn` keeps CUDA from fusing Q2_K's d*q - m into one fma), so
the dequantization kernel gives `gguf.quants.dequantize`'s values bit for bit, and the product
differs from MLX's only by summation order; Q6_K's own kernel with 2-byte x rounds x to int16 for
integer products (within `q6k_rounding_step`'s bound).

The Metal sources mirror the CUDA ones line for line (simdgroups of 32, the same lane mapping).
They have not been run: the project has no Mac in its test machines; `ready()` compares them with
MLX once per process before a model uses them, as it does the CUDA ones.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.constants import GGML_QUANT_SIZES

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core.cuda_kernel import SharedKernel

from ..formats.gguf_quants import dequantize_blocks
from .check import CheckedOnce
from .matvec import HEADER as MATVEC_HEADER
from .metal_kernel import SharedMetalKernel, device_kind, dialect

QK_K = 256
TYPE_IDS = {QType.Q2_K: 10, QType.Q3_K: 11, QType.Q6_K: 14}  # ggml's type numbers: the template's Q
MAX_X_ROWS = 8  # more rows of x (prefill) dequantize chunks of rows for MLX's matmul instead
ROWS_PER_WARP = 2
THREADS = 128  # per block / threadgroup: 4 warps
FLOAT_TYPES = (mx.float16, mx.bfloat16, mx.float32)  # x dtypes the kernels take

# ---------------------------------------------------------------------------------------- CUDA

CUDA_HEADER = r"""
namespace pymlxc_gguf {

__device__ __forceinline__ float half_at(const uint8_t* p) {
  // Blocks of 84/110/210 bytes leave a float16 field only 2-byte aligned: read it byte-wise.
  return __half2float(__ushort_as_half(static_cast<unsigned short>(p[0] | (p[1] << 8))));
}

// 8 values into o[0..8) as T: one 16-byte store (two for float32) where o is aligned to it (a row
// of whole 256-value blocks always is), else one store a value. A warp's stores then fill whole
// memory sectors, where eight 2-byte stores a thread each touched 16 of them.
template <typename T>
__device__ __forceinline__ void store8(T* o, const float* v) {
  if ((reinterpret_cast<size_t>(o) & 15u) == 0) {
    uint32_t w[8];  // the 8 values' bits: 4 words of 2-byte values, 8 of float32 ones
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const T x = static_cast<T>(v[i]);
      if (sizeof(T) == 2) {
        const uint32_t bits = *reinterpret_cast<const unsigned short*>(&x);
        w[i >> 1] = (i & 1) ? (w[i >> 1] | (bits << 16)) : bits;
      } else {
        w[i] = *reinterpret_cast<const uint32_t*>(&x);
      }
    }
    uint4* d = reinterpret_cast<uint4*>(o);
#pragma unroll
    for (int j = 0; j < static_cast<int>(sizeof(T)) / 2; ++j) {
      d[j] = make_uint4(w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      o[i] = static_cast<T>(v[i]);
    }
  }
}

// The 8 values p0..p0+7 (p0 a multiple of 8) of the block at b, in float32, as gguf's reference.
template <int Q>
__device__ __forceinline__ void values8(const uint8_t* b, int p0, float* v) {
  const int n = p0 >> 7, k = (p0 & 127) >> 5, l = p0 & 31, s = p0 >> 4;
  if (Q == 14) {  // Q6_K
    const float dl = half_at(b + 208) * static_cast<float>(static_cast<int8_t>(b[192 + s]));
    const uint8_t* ql = b + 64 * n + 32 * (k & 1) + l;
    const uint8_t* qh = b + 128 + 32 * n + l;
    const int sl = 4 * (k >> 1), sh = 2 * k;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int q = ((ql[i] >> sl) & 15) | (((qh[i] >> sh) & 3) << 4);
      v[i] = __fmul_rn(dl, static_cast<float>(q) - 32.f);
    }
  } else if (Q == 11) {  // Q3_K
    int sc = (s < 8) ? (b[96 + s] & 15) : (b[88 + s] >> 4);
    sc |= ((b[104 + (s & 3)] >> (2 * (s >> 2))) & 3) << 4;
    const float dl = half_at(b + 108) * (static_cast<float>(sc) - 32.f);
    const uint8_t* qs = b + 32 + 32 * n + l;
    const uint8_t* hm = b + l;
    const int j = p0 >> 5;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int q = ((qs[i] >> (2 * k)) & 3) - (((hm[i] >> j) & 1) ? 0 : 4);
      v[i] = __fmul_rn(dl, static_cast<float>(q));
    }
  } else {  // Q2_K
    const int sc = b[s];
    const float dl = half_at(b + 80) * static_cast<float>(sc & 15);
    const float ml = half_at(b + 82) * static_cast<float>(sc >> 4);
    const uint8_t* qs = b + 16 + 32 * n + l;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = __fsub_rn(__fmul_rn(dl, static_cast<float>((qs[i] >> (2 * k)) & 3)), ml);
    }
  }
}

}  // namespace pymlxc_gguf
"""

# The matvecs' loop over blocks, for both kernels (`metal_kernel.dialect`): the blocks FIRST_BLOCK,
# FIRST_BLOCK + BLOCK_STEP, ... of R rows, a lane's 8 values of each times M rows of x, summed per
# lane into acc[M][R] (each kernel then reduces them its way).
_MATVEC_BLOCKS = r"""
  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      acc[m][r] = 0.f;
    }
  }
  for (int blk = FIRST_BLOCK; blk < NB; blk += BLOCK_STEP) {
    float v[R][8];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      // Rows past N (the last rows) read row N - 1 again; their sums are never written.
      const size_t row = static_cast<size_t>(min(row0 + r, N - 1));
      pymlxc_gguf::values8<Q>(wm + (row * NB + blk) * S, lane * 8, v[r]);
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const DEVICE T* xm = xp + static_cast<size_t>(m) * K + blk * 256 + lane * 8;
      float xf[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        xf[i] = static_cast<float>(xm[i]);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          d = fmaf(xf[i], v[r][i], d);
        }
        acc[m][r] += d;
      }
    }
  }
"""


def _blocks(first: str, step: str, cuda: bool) -> str:
    return dialect(_MATVEC_BLOCKS.replace("FIRST_BLOCK", first).replace("BLOCK_STEP", step), cuda=cuda)


# The CUDA matvecs' end: each warp's lane sums meet by shuffles, then in shared memory `part`
# [warps][M][R], where the `split` warps of each of the thread block's `groups` row groups (R rows
# each, group g of block b holding rows (b groups + g) R ..) add up and write their rows.
_CUDA_REDUCE = r"""
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float s = acc[m][r];
      for (int off = 16; off > 0; off >>= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, off);
      }
      if (lane == 0) {
        part[warp][m][r] = s;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x < GROUPS * M * R) {
    const int g = threadIdx.x / (M * R), m = (threadIdx.x / R) % M, r = threadIdx.x % R;
    const int row = (blockIdx.x * GROUPS + g) * R + r;
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < SPLIT; ++j) {
      s += part[g * SPLIT + j][m][r];
    }
    if (row < N) {
      out[(static_cast<size_t>(pair) * M + m) * N + row] = static_cast<T>(s);
    }
  }
"""


# The start of both CUDA matvecs: the warps of a thread block, the shared sums of their split rows,
# the sizes from w's shape at run time, and this thread's place.
_CUDA_WARPS = r"""
  constexpr int WARPS = """ + str(THREADS // 32) + r""";
"""
_CUDA_ROWS = r"""  __shared__ float part[WARPS][M][R];
  const int N = w_shape[1];
  const int NB = w_shape[2];
  const int K = NB * 256;
  const int pair = blockIdx.y;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
"""


def _cuda_reduce(groups: str, split: str) -> str:
    return _CUDA_REDUCE.replace("GROUPS", groups).replace("SPLIT", split)


# Template arguments: T (x and out), M (rows of x per pair), Q (ggml type), S (bytes a block),
# R (output rows per thread block). x [P, M, K], w [E, N, NB, S] uint8, idx [P] int32 (the matrix of
# each pair: 0 for a plain linear, the expert for a switch layer) -> out [P, M, N]. Grid: blocks of
# THREADS across (R rows each), pairs down. The block's warps split a row's blocks between them
# (warp j takes blocks j, j + WARPS, ...) and their sums meet in shared memory: a narrow matrix
# (2048 or 4096 rows of 8192 or 14336 weights) still keeps every SM's warps busy, where a warp per
# row pair walked all of a row alone. Sizes come from w's shape at run time, so a model's layers
# share one compiled kernel.
CUDA_MATVEC_SOURCE = _CUDA_WARPS + _CUDA_ROWS + r"""  const int row0 = blockIdx.x * R;
  const uint8_t* wm = w + static_cast<size_t>(idx[pair]) * N * NB * S;
  const T* xp = x + static_cast<size_t>(pair) * M * K;""" + _blocks("warp", "WARPS", cuda=True) \
    + _cuda_reduce(groups="1", split="WARPS")

# Q6_K on CUDA. A warp's step is 4 consecutive blocks of each of its R rows (840 bytes a row): it
# copies them into shared memory with 16-byte loads from the 16-byte boundary below them (whole
# lines per load instruction: the blocks are only 2-byte aligned, and reading them in place cost
# several cache lines per instruction), and loads the next step's bytes before working on these.
# Then 8 lanes share a block, lane j taking the 32 values 128 (j / 4) + 32 k + 8 (j % 4) + i
# (k = 0..3, i = 0..7): exactly the values whose low nibbles lie in 2 x 8 bytes of ql and whose
# high bits lie in 8 bytes of qh. With 2-byte x the products are integers, as in matvec.py's 4-bit
# kernel: the lane rounds its 32 values of x to int16 against their largest (an error of at most
# max |x| / 65534 a value, `q6k_rounding_step`), and `dp2a` multiplies them with the codes, 0..63
# a byte: sum x d sc (q - 32) = d sc dx (sum xi q - 32 sum xi) per 8 values of one scale, the
# second sum taken once per x for all R rows. float32 x keeps float products (codes become floats
# through the mantissa, 2^23 + q), equal to the reference's values up to float32 rounding.
# Template arguments: T, M, R as above, W (warps per R rows: they split the row's steps). A thread
# block has THREADS / 32 warps, so THREADS / 32 / W groups of R rows.
CUDA_Q6K_MATVEC_HEADER = CUDA_HEADER + MATVEC_HEADER + r"""
namespace pymlxc_gguf {

// 8 bytes at p (2-byte aligned) as two words, through the 4-byte-aligned words around them; the
// third word only when the 8 bytes straddle it.
__device__ __forceinline__ void load8_aligned2(const uint8_t* p, uint32_t& lo, uint32_t& hi) {
  const uint32_t* a = reinterpret_cast<const uint32_t*>(reinterpret_cast<size_t>(p) & ~size_t(3));
  const unsigned shift = (reinterpret_cast<size_t>(p) & 3u) * 8u;
  const uint32_t w0 = a[0], w1 = a[1], w2 = shift ? a[2] : 0u;
  lo = __funnelshift_r(w0, w1, shift);
  hi = __funnelshift_r(w1, w2, shift);
}

// Byte i of q (0..63) minus 32, as a float: 2^23 + q is the float with q in its low mantissa.
__device__ __forceinline__ float code_minus_32(uint32_t q, int i) {
  return __uint_as_float(__byte_perm(q, 0x4B000000u, 0x7440u + i)) - 8388640.f;
}

// Eight values of x as floats: one 16-byte load for 2-byte floats (matvec.py's load8).
template <typename T>
__device__ __forceinline__ void load_x8(const T* p, float* f) {
  if (sizeof(T) == 2) {
    pymlxc_mv::load8<T>(p, f);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      f[i] = static_cast<float>(p[i]);
    }
  }
}

// The codes (0..63) of 4 of a lane's values, one a byte: values 32 k + 4 h .. + 3 of its 32, from
// the words at bytes 64 half + l0 + 4 h (a), + 32 (b) of ql and 32 half + l0 + 4 h (c) of qh.
__device__ __forceinline__ uint32_t q6k_codes(uint32_t a, uint32_t b, uint32_t c, int k) {
  switch (k) {
    case 0: return (a & 0x0F0F0F0Fu) | ((c << 4) & 0x30303030u);
    case 1: return (b & 0x0F0F0F0Fu) | ((c << 2) & 0x30303030u);
    case 2: return ((a >> 4) & 0x0F0F0F0Fu) | (c & 0x30303030u);
    default: return ((b >> 4) & 0x0F0F0F0Fu) | ((c >> 2) & 0x30303030u);
  }
}

// The scale of a lane's values 32 k .. + 7, value 128 half + 32 k + l0 of the block: sc[8 half +
// 2 k + l0 / 16], byte 2 k + l0 / 16 of the 8 scale bytes s (from byte 192 + 8 half).
__device__ __forceinline__ float q6k_scale(const uint32_t* s, int l0, int k) {
  const int byte = 2 * k + (l0 >> 4);
  return static_cast<float>(static_cast<int8_t>((s[byte >> 2] >> (8 * (byte & 3))) & 0xFFu));
}

// A lane's 32 values of x, xf[k][i], rounded to int16 as matvec.py's products round them (returns
// the step dx), two to an int: xi[k][j] holds values 2 j and 2 j + 1 of group k, the pair
// `__dp2a_lo` / `__dp2a_hi` take with a word's bytes (0, 1) / (2, 3). base[k] = -32 sum_i xi[k][i],
// the codes' offset of 32 applied once per group of 8.
__device__ __forceinline__ float quantize_lane(const float (*xf)[8], int (*xi)[4], int* base) {
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      amax = fmaxf(amax, fabsf(xf[k][i]));
    }
  }
  const float inv = pymlxc_mv::int16_inverse(amax);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    base[k] = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      xi[k][j] = pymlxc_mv::int16_pair(xf[k][2 * j], xf[k][2 * j + 1], inv);
      base[k] = __dp2a_lo(xi[k][j], static_cast<int>(0xE0E0E0E0u), base[k]);  // bytes of -32
    }
  }
  return pymlxc_mv::int16_step(amax);
}

}  // namespace pymlxc_gguf
"""

# Both Q6_K kernels: a warp's group of R rows and its split of their steps (W warps a group), then
# its lanes (8 a block, 4 blocks a step: lane sub of block bq takes values 128 half + 32 k + l0 + i)
# and their sums.
_Q6K_ROWS = r"""  const int group = warp / W, split = warp % W;
  const int row0 = (blockIdx.x * (WARPS / W) + group) * R;
"""
_Q6K_LANES = r"""  const T* xp = x + static_cast<size_t>(pair) * M * K;
  const int sub = lane & 7, half = sub >> 2, l0 = (sub & 3) * 8, bq = lane >> 3;
  const int steps = (NB + 3) / 4;
  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      acc[m][r] = 0.f;
    }
  }
"""

# The Q6_K kernels' products (both layouts): a lane's 32 values of block `blk` of each of the R rows,
# from the words va (ql, values 32 k + 0..7 for k = 0, 2), vb (ql, k = 1, 3), vc (qh), vs (8 scales) and
# the scale d, times M rows of x, summed into acc[M][R].
_Q6K_PRODUCTS = r"""#pragma unroll
    for (int m = 0; m < M; ++m) {
      const T* xm = xp + static_cast<size_t>(m) * K + blk * 256 + 128 * half + l0;
      float xf[4][8];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        pymlxc_gguf::load_x8<T>(xm + 32 * k, xf[k]);
      }
      if (sizeof(T) == 2) {
        // Integer products: the lane's 32 values of x rounded to int16 against their largest
        // (matvec.py's rounding), sum x (q - 32) = dx (sum xi q - 32 sum xi) per 8 values of a scale.
        int xi[4][4];
        int base[4];
        const float dx = pymlxc_gguf::quantize_lane(xf, xi, base);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float sum = 0.f;
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            int dot = base[k];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int q = static_cast<int>(pymlxc_gguf::q6k_codes(va[r][h], vb[r][h], vc[r][h], k));
              dot = __dp2a_lo(xi[k][2 * h], q, dot);
              dot = __dp2a_hi(xi[k][2 * h + 1], q, dot);
            }
            sum = fmaf(pymlxc_gguf::q6k_scale(vs[r], l0, k), static_cast<float>(dot), sum);
          }
          acc[m][r] = fmaf(d[r] * dx, sum, acc[m][r]);
        }
      } else {
        // float32 x: float products, float32's own precision.
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float sum = 0.f;
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            float part = 0.f;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const uint32_t q = pymlxc_gguf::q6k_codes(va[r][h], vb[r][h], vc[r][h], k);
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                part = fmaf(xf[k][4 * h + i], pymlxc_gguf::code_minus_32(q, i), part);
              }
            }
            sum = fmaf(pymlxc_gguf::q6k_scale(vs[r], l0, k), part, sum);
          }
          acc[m][r] = fmaf(d[r], sum, acc[m][r]);
        }
      }
    }
"""

CUDA_Q6K_MATVEC_SOURCE = _CUDA_WARPS + (
    "  constexpr int CHUNKS = 54;  // 16-byte chunks that hold 840 bytes starting anywhere in the first one\n"
    "  __shared__ uint4 stage[WARPS][R][CHUNKS];\n") + _CUDA_ROWS + _Q6K_ROWS + (
    "  const uint8_t* wm = w + static_cast<size_t>(idx[pair]) * N * NB * 210;\n") + _Q6K_LANES + r"""
  // The next step's chunks (lane, lane + 32) of each row, and where its first block starts in them.
  uint4 held[R][2];
  int held_at[R];
  int q = split;
  if (q < steps) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      // Rows past N (the last group) read row N - 1 again; their sums are never written.
      const uint8_t* p = wm + (static_cast<size_t>(min(row0 + r, N - 1)) * NB + 4 * q) * 210;
      const uint4* a = reinterpret_cast<const uint4*>(reinterpret_cast<size_t>(p) & ~size_t(15));
      held_at[r] = static_cast<int>(reinterpret_cast<size_t>(p) & 15u);
      const int need = (held_at[r] + min(4, NB - 4 * q) * 210 + 15) >> 4;
      held[r][0] = lane < need ? a[lane] : make_uint4(0u, 0u, 0u, 0u);
      held[r][1] = lane + 32 < need ? a[lane + 32] : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  while (q < steps) {
    int at[R];
    __syncwarp();
#pragma unroll
    for (int r = 0; r < R; ++r) {
      stage[warp][r][lane] = held[r][0];
      if (lane + 32 < CHUNKS) {
        stage[warp][r][lane + 32] = held[r][1];
      }
      at[r] = held_at[r];
    }
    __syncwarp();
    const int blk = 4 * q + bq;
    q += W;
    if (q < steps) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = wm + (static_cast<size_t>(min(row0 + r, N - 1)) * NB + 4 * q) * 210;
        const uint4* a = reinterpret_cast<const uint4*>(reinterpret_cast<size_t>(p) & ~size_t(15));
        held_at[r] = static_cast<int>(reinterpret_cast<size_t>(p) & 15u);
        const int need = (held_at[r] + min(4, NB - 4 * q) * 210 + 15) >> 4;
        held[r][0] = lane < need ? a[lane] : make_uint4(0u, 0u, 0u, 0u);
        held[r][1] = lane + 32 < need ? a[lane + 32] : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    if (blk >= NB) {
      continue;
    }
    uint32_t va[R][2], vb[R][2], vc[R][2], vs[R][2];
    float d[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = reinterpret_cast<const uint8_t*>(stage[warp][r]) + at[r] + 210 * bq;
      pymlxc_gguf::load8_aligned2(b + 64 * half + l0, va[r][0], va[r][1]);
      pymlxc_gguf::load8_aligned2(b + 64 * half + 32 + l0, vb[r][0], vb[r][1]);
      pymlxc_gguf::load8_aligned2(b + 128 + 32 * half + l0, vc[r][0], vc[r][1]);
      pymlxc_gguf::load8_aligned2(b + 192 + 8 * half, vs[r][0], vs[r][1]);
      d[r] = pymlxc_gguf::half_at(b + 208);
    }
""" + _Q6K_PRODUCTS + r"""  }
""" + _cuda_reduce(groups="(WARPS / W)", split="W")

# Q6_K on CUDA, the blocks of a matrix rearranged at load into four planes (`to_planes`): each
# lane's bytes then lie at 16-, 8- and 2-byte aligned places, read straight from memory where the
# file's layout (210-byte blocks, 2-byte aligned) was copied through shared memory and shifted.
# The same lanes, steps, products and sums as CUDA_Q6K_MATVEC_SOURCE: the same values bit for bit.
# w [1, N, NB, 210] holds, for the N NB blocks u = row NB + block in order: ql (128 bytes each, lane
# sub's 16 bytes at 16 sub: ql[64 h + l0 .. + 8] then ql[64 h + 32 + l0 .. + 8]), qh (64 bytes each,
# as in the block), the scales (16 each), d (2 each).
CUDA_Q6K_PLANES_SOURCE = _CUDA_WARPS + _CUDA_ROWS + _Q6K_ROWS + r"""  const size_t units = static_cast<size_t>(N) * NB;
  const uint8_t* qlp = w;
  const uint8_t* qhp = w + units * 128;
  const uint8_t* scp = w + units * 192;
  const uint8_t* dp = w + units * 208;
""" + _Q6K_LANES + r"""  for (int q = split; q < steps; q += W) {
    const int blk = 4 * q + bq;
    if (blk >= NB) {
      continue;
    }
    uint32_t va[R][2], vb[R][2], vc[R][2], vs[R][2];
    float d[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      // Rows past N (the last group) read row N - 1 again; their sums are never written.
      const size_t u = static_cast<size_t>(min(row0 + r, N - 1)) * NB + blk;
      const uint4 l = *reinterpret_cast<const uint4*>(qlp + u * 128 + 16 * sub);
      const uint2 h = *reinterpret_cast<const uint2*>(qhp + u * 64 + 8 * sub);
      const uint2 s = *reinterpret_cast<const uint2*>(scp + u * 16 + 8 * half);
      va[r][0] = l.x;
      va[r][1] = l.y;
      vb[r][0] = l.z;
      vb[r][1] = l.w;
      vc[r][0] = h.x;
      vc[r][1] = h.y;
      vs[r][0] = s.x;
      vs[r][1] = s.y;
      d[r] = __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(dp + u * 2)));
    }
""" + _Q6K_PRODUCTS + r"""  }
""" + _cuda_reduce(groups="(WARPS / W)", split="W")

# Template arguments: T (out), Q, S. w [rows, NB, S] -> out [rows, NB * 256]; thread t writes the
# 8 values 8 (t % 32) of block (t / 32) % NB of row t / (32 NB).
CUDA_DEQUANT_SOURCE = r"""
  const size_t rows = w_shape[0];
  const int NB = w_shape[1];
  const size_t t = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t unit = t >> 5;  // (row, block)
  if (unit >= rows * NB) {
    return;
  }
  float v[8];
  pymlxc_gguf::values8<Q>(w + unit * S, (t & 31) * 8, v);
  pymlxc_gguf::store8<T>(out + unit * 256 + (t & 31) * 8, v);
"""

# Q6_K planes (`to_planes`) read back as values, with the block kernel's float32 operations (`values8`'s
# Q6_K branch, the bytes read from the planes): the same values bit for bit.
CUDA_PLANES_HEADER = CUDA_HEADER + r"""
namespace pymlxc_gguf {

// The 8 values p0..p0+7 of unit u (row NB + block) of planes w holding `units` units, as floats.
// Their ql and qh bytes lie 8-byte aligned in the planes (`to_planes`): read as one word pair each
// where the planes start aligned (always, unless handed a view), else byte by byte.
__device__ __forceinline__ void planes_values8(const uint8_t* w, size_t units, size_t u, int p0, float* v) {
  const int n = p0 >> 7, k = (p0 & 127) >> 5, l = p0 & 31, s = p0 >> 4;
  // ql[64 n + 32 (k & 1) + l + i] lies at 16 (4 n + l / 8) + 8 (k & 1) + i of the unit's 128 (to_planes).
  const uint8_t* ql = w + u * 128 + 16 * (4 * n + (l >> 3)) + 8 * (k & 1);
  const uint8_t* qh = w + units * 128 + u * 64 + 32 * n + l;
  const float dl = half_at(w + units * 208 + u * 2)
      * static_cast<float>(static_cast<int8_t>(w[units * 192 + u * 16 + s]));
  uint32_t lo[2], hi[2];
  if (((reinterpret_cast<size_t>(ql) | reinterpret_cast<size_t>(qh)) & 7u) == 0) {
    const uint2 a = *reinterpret_cast<const uint2*>(ql);
    const uint2 b = *reinterpret_cast<const uint2*>(qh);
    lo[0] = a.x, lo[1] = a.y, hi[0] = b.x, hi[1] = b.y;
  } else {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      lo[j] = ql[4 * j] | (ql[4 * j + 1] << 8) | (ql[4 * j + 2] << 16) | (static_cast<uint32_t>(ql[4 * j + 3]) << 24);
      hi[j] = qh[4 * j] | (qh[4 * j + 1] << 8) | (qh[4 * j + 2] << 16) | (static_cast<uint32_t>(qh[4 * j + 3]) << 24);
    }
  }
  const int sl = 4 * (k >> 1), sh = 2 * k;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t lb = lo[i >> 2] >> (8 * (i & 3)), hb = hi[i >> 2] >> (8 * (i & 3));
    const int q = static_cast<int>(((lb >> sl) & 15u) | (((hb >> sh) & 3u) << 4));
    v[i] = __fmul_rn(dl, static_cast<float>(q) - 32.f);
  }
}

}  // namespace pymlxc_gguf
"""

# Rows ids[0..] of planes (an embedding lookup, or a prefill chunk's rows: `gguf_layers.planes_rows`).
# w [N, NB, 210], ids int32 [T] -> out [T, NB * 256];
# an id outside 0..N-1 reads the nearest row (ids are checked against the vocabulary before a model
# sees them; this keeps a bad one inside the weights).
CUDA_LOOKUP_PLANES_SOURCE = r"""
  const int N = w_shape[0];
  const int NB = w_shape[1];
  const size_t units = static_cast<size_t>(N) * NB;
  const size_t count = static_cast<size_t>(ids_shape[0]) * NB;
  const size_t t = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t unit = t >> 5;
  if (unit >= count) {
    return;
  }
  const int row = min(max(ids[unit / NB], 0), N - 1);
  float v[8];
  pymlxc_gguf::planes_values8(w, units, static_cast<size_t>(row) * NB + unit % NB, static_cast<int>(t & 31) * 8, v);
  pymlxc_gguf::store8<T>(out + unit * 256 + (t & 31) * 8, v);
"""

# ---------------------------------------------------------------------------------------- Metal

METAL_HEADER = r"""
namespace pymlxc_gguf {

inline float half_at(const device uint8_t* p) {
  return float(as_type<half>(ushort(p[0]) | (ushort(p[1]) << 8)));
}

template <int Q>
inline void values8(const device uint8_t* b, int p0, thread float* v) {
  const int n = p0 >> 7, k = (p0 & 127) >> 5, l = p0 & 31, s = p0 >> 4;
  if (Q == 14) {
    const float dl = half_at(b + 208) * float(as_type<char>(b[192 + s]));
    const device uint8_t* ql = b + 64 * n + 32 * (k & 1) + l;
    const device uint8_t* qh = b + 128 + 32 * n + l;
    const int sl = 4 * (k >> 1), sh = 2 * k;
    for (int i = 0; i < 8; ++i) {
      const int q = ((ql[i] >> sl) & 15) | (((qh[i] >> sh) & 3) << 4);
      v[i] = dl * (float(q) - 32.f);
    }
  } else if (Q == 11) {
    int sc = (s < 8) ? (b[96 + s] & 15) : (b[88 + s] >> 4);
    sc |= ((b[104 + (s & 3)] >> (2 * (s >> 2))) & 3) << 4;
    const float dl = half_at(b + 108) * (float(sc) - 32.f);
    const device uint8_t* qs = b + 32 + 32 * n + l;
    const device uint8_t* hm = b + l;
    const int j = p0 >> 5;
    for (int i = 0; i < 8; ++i) {
      const int q = ((qs[i] >> (2 * k)) & 3) - (((hm[i] >> j) & 1) ? 0 : 4);
      v[i] = dl * float(q);
    }
  } else {
    const int sc = b[s];
    const float dl = half_at(b + 80) * float(sc & 15);
    const float ml = half_at(b + 82) * float(sc >> 4);
    const device uint8_t* qs = b + 16 + 32 * n + l;
    for (int i = 0; i < 8; ++i) {
      v[i] = dl * float((qs[i] >> (2 * k)) & 3) - ml;
    }
  }
}

}  // namespace pymlxc_gguf
"""

METAL_MATVEC_SOURCE = r"""
  const int N = w_shape[1];
  const int NB = w_shape[2];
  const int K = NB * 256;
  const int pair = thread_position_in_grid.y;
  const int lane = thread_index_in_simdgroup;
  const int row0 = int(thread_position_in_grid.x >> 5) * R;
  if (row0 >= N) {
    return;
  }
  const device uint8_t* wm = w + size_t(idx[pair]) * N * NB * S;
  const device T* xp = x + size_t(pair) * M * K;""" + _blocks("0", "1", cuda=False) + r"""
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      const float s = simd_sum(acc[m][r]);
      if (lane == 0 && row0 + r < N) {
        out[(size_t(pair) * M + m) * N + row0 + r] = T(s);
      }
    }
  }
"""

METAL_DEQUANT_SOURCE = r"""
  const size_t rows = w_shape[0];
  const int NB = w_shape[1];
  const size_t t = thread_position_in_grid.x;
  const size_t unit = t >> 5;
  if (unit >= rows * NB) {
    return;
  }
  float v[8];
  pymlxc_gguf::values8<Q>(w + unit * S, int(t & 31) * 8, v);
  device T* o = out + unit * 256 + (t & 31) * 8;
  for (int i = 0; i < 8; ++i) {
    o[i] = T(v[i]);
  }
"""

_cuda_matvec = SharedKernel("pymlxc_gguf_matvec", ("x", "w", "idx"), ("out",), CUDA_MATVEC_SOURCE,
                            header=CUDA_HEADER)
_cuda_q6k_matvec = SharedKernel("pymlxc_gguf_q6k_matvec", ("x", "w", "idx"), ("out",), CUDA_Q6K_MATVEC_SOURCE,
                                header=CUDA_Q6K_MATVEC_HEADER)
_cuda_q6k_planes = SharedKernel("pymlxc_gguf_q6k_planes", ("x", "w"), ("out",), CUDA_Q6K_PLANES_SOURCE,
                                header=CUDA_Q6K_MATVEC_HEADER)
_cuda_dequant = SharedKernel("pymlxc_gguf_dequant", ("w",), ("out",), CUDA_DEQUANT_SOURCE,
                             header=CUDA_HEADER)
_cuda_lookup_planes = SharedKernel("pymlxc_gguf_q6k_planes_lookup", ("w", "ids"), ("out",),
                                   CUDA_LOOKUP_PLANES_SOURCE, header=CUDA_PLANES_HEADER)
_metal_matvec = SharedMetalKernel("pymlxc_gguf_matvec", ("x", "w", "idx"), ("out",), METAL_MATVEC_SOURCE,
                                  header=METAL_HEADER)
_metal_dequant = SharedMetalKernel("pymlxc_gguf_dequant", ("w",), ("out",), METAL_DEQUANT_SOURCE,
                                   header=METAL_HEADER)
# Per device kind: (matvec, dequantize); both kinds' kernels take the same call.
_KERNELS: dict[str, tuple[SharedKernel | SharedMetalKernel, SharedKernel | SharedMetalKernel]] = {
    "cuda": (_cuda_matvec, _cuda_dequant), "metal": (_metal_matvec, _metal_dequant)}


def q6k_rounding_step(x: np.ndarray) -> np.ndarray:
    """The largest change the CUDA Q6_K kernel's int16 rounding makes to each value of x [..., K]
    (2-byte x): half a step, max |x| / 65534 over the 32 values one lane rounds together, values
    128 h + 32 k + 8 j + i (k, i over 0..3, 0..7) of each block for its h and j. The product's
    error from it is at most this times |w|, summed over K."""
    lanes = np.abs(x).reshape(*x.shape[:-1], -1, 2, 4, 4, 8)  # blocks, h, k, j, i
    amax = lanes.max(axis=(-3, -1), keepdims=True)  # over k and i
    return np.broadcast_to(amax / 65534, lanes.shape).reshape(x.shape)


def x_rounding_bound(kind: str, qtype: QType, dtype_size: int, x: np.ndarray, w: np.ndarray) -> np.ndarray | float:
    """The most `matvec`'s rounding of x can move its products x [P, M, K] @ w [P, N, K].T (float64):
    Q6_K's CUDA kernel with 2-byte x rounds x to int16 (`q6k_rounding_step` times |w|, with a
    thousandth for the step's own float32 rounding); the other kernels keep x as it is (0)."""
    if kind != "cuda" or qtype != QType.Q6_K or dtype_size != 2:
        return 0.0
    bound: np.ndarray = 1.001 * np.einsum("pmk,pnk->pmn", q6k_rounding_step(x), np.abs(w))
    return bound


def q6k_rows(x_rows: int) -> int:
    """Output rows a warp of the CUDA Q6_K matvec takes for `x_rows` rows of x: four for one (each
    lane's rounding of x then serves four rows: Llama-3.1-8B's head 209 against 229 us on the H100,
    the 1B's 132 against 131, `probe_gguf_blocks.py` at 658037c), else two (registers: eight rows of
    x and four of weights take 224 a thread)."""
    return 4 if x_rows == 1 else ROWS_PER_WARP


def q6k_warps(n: int, blocks: int) -> int:
    """Warps per row group of the CUDA Q6_K matvec for n rows of `blocks` blocks: one where the rows
    alone fill the device (an output head: 131 us on the H100 for the 1B's, against 155 and 212 with
    2 and 4), else enough that each warp has a few blocks' steps (the 8B down projection: 42-45 us
    with 2 or 4, 157 with 1; narrower matrices were bound by the probe's host time, not measured;
    `probe_gguf_blocks.py` at 658037c, the integer products)."""
    if n >= 16384:
        return 1
    steps = -(-blocks // 4)  # a warp's steps over a row when it works alone
    return 4 if steps >= 8 else 2 if steps >= 2 else 1


def matvec(x: Array, w: Array, idx: Array, qtype: QType, kind: str,
           rows_per_warp: int | None = None, warps: int | None = None, generic: bool = False,
           planes: bool = False) -> Array:
    """out [P, M, N] = x [P, M, K] @ dequantize(w[idx[p]]).T for blocks w [E, N, K/256, S] uint8
    and idx [P] int32, through the `kind` ("cuda" / "metal") kernel; M at most MAX_X_ROWS. Q6_K on
    CUDA takes its own kernel (`warps` per row group, `q6k_warps` by default; `rows_per_warp`,
    `q6k_rows` by default) unless `generic`. `planes`: w [1, N, K/256, 210] in `to_planes`'s layout
    (Q6_K on CUDA only)."""
    p, m, _ = x.shape
    n, size = w.shape[1], w.shape[3]
    if planes and (kind != "cuda" or qtype != QType.Q6_K or w.shape[0] != 1):
        raise ValueError("the planes layout is for one Q6_K matrix on CUDA")
    if kind == "cuda" and qtype == QType.Q6_K and not generic:
        w_per = warps or q6k_warps(n, w.shape[2])
        rows = rows_per_warp or q6k_rows(m)
        groups = -(-n // (rows * (THREADS // 32 // w_per)))
        kernel, inputs = (_cuda_q6k_planes, [x, w]) if planes else (_cuda_q6k_matvec, [x, w, idx])
        (out,) = kernel()(inputs, output_shapes=[(p, m, n)], output_dtypes=[x.dtype],
                          grid=(groups * THREADS, p, 1), threadgroup=(THREADS, 1, 1),
                          template=[("T", x.dtype), ("M", m), ("R", rows), ("W", w_per)])
        return out
    rows_per_warp = rows_per_warp or ROWS_PER_WARP
    # CUDA: a thread block of THREADS per `rows_per_warp` rows (its warps split each row's
    # blocks); Metal: a simdgroup per `rows_per_warp` rows.
    groups = -(-n // rows_per_warp)
    width = groups * (THREADS if kind == "cuda" else 32)
    (out,) = _KERNELS[kind][0]()([x, w, idx], output_shapes=[(p, m, n)], output_dtypes=[x.dtype],
                                 grid=(width, p, 1), threadgroup=(THREADS, 1, 1),
                                 template=[("T", x.dtype), ("M", m), ("Q", TYPE_IDS[qtype]), ("S", size),
                                           ("R", rows_per_warp)])
    return out


def dequantize(w: Array, qtype: QType, dtype: Any, kind: str) -> Array:
    """Blocks w [rows, NB, S] uint8 -> [rows, NB * 256] of `dtype`, through the `kind` kernel
    (float32: `gguf.quants.dequantize`'s values exactly)."""
    rows, nb, size = w.shape
    (out,) = _KERNELS[kind][1]()([w], output_shapes=[(rows, nb * QK_K)], output_dtypes=[dtype],
                                 grid=(rows * nb * 32, 1, 1), threadgroup=(THREADS, 1, 1),
                                 template=[("T", dtype), ("Q", TYPE_IDS[qtype]), ("S", size)])
    return out


# ---------------------------------------------------------------------------------------- Q6_K planes

Q6K_SIZE = 210
# ql[64 h + 32 c + 8 j + i] (h, c < 2; j < 4; i < 8) goes to byte 16 (4 h + j) + 8 c + i of its block's
# 128 in the ql plane: lane (4 h + j)'s 16 bytes, the two 8-byte runs of ql it reads, side by side.
_QL_SPLIT = (2, 2, 4, 8)  # h, c, j, i
_QL_ORDER = (0, 1, 3, 2, 4)  # (unit, h, c, j, i) -> (unit, h, j, c, i)


def to_planes(w: Array) -> Array:
    """Q6_K blocks w [N, NB, 210] (the file's layout) -> the same bytes as the planes the CUDA planes
    kernel reads, [N, NB, 210]: for the N NB blocks in order, every block's ql (lane-ordered, see
    _QL_SPLIT), then every qh, every scales, every d. A permutation of the bytes: `from_planes`
    gives back w exactly."""
    n, nb, size = w.shape
    if size != Q6K_SIZE:
        raise ValueError(f"Q6_K blocks are {Q6K_SIZE} bytes, not {size}")
    u = mx.reshape(w, (n * nb, size))
    ql = mx.transpose(mx.reshape(u[:, :128], (n * nb, *_QL_SPLIT)), _QL_ORDER)
    parts = [mx.reshape(ql, (-1,)), mx.reshape(u[:, 128:192], (-1,)), mx.reshape(u[:, 192:208], (-1,)),
             mx.reshape(u[:, 208:], (-1,))]
    return mx.reshape(mx.concatenate(parts), (n, nb, size))


def _rows_as_blocks(p: Array, pick: Callable[[Array], Array], count: int) -> Array:
    """`count` rows of planes p [N, NB, 210] as Q6_K blocks [count, NB, 210]: `pick` takes them from
    each plane seen as [N, NB * width] (a slice or a take: no copy of the other rows)."""
    n, nb, size = p.shape
    units, flat = n * nb, mx.reshape(p, (-1,))

    def plane(offset: int, width: int) -> Array:
        return mx.reshape(pick(mx.reshape(flat[offset:offset + units * width], (n, nb * width))),
                          (count * nb, width))

    ql = mx.transpose(mx.reshape(plane(0, 128), (count * nb, 2, 4, 2, 8)), _QL_ORDER)  # (h, j, c, i) -> (h, c, j, i)
    blocks = mx.concatenate([mx.reshape(ql, (count * nb, 128)), plane(units * 128, 64), plane(units * 192, 16),
                             plane(units * 208, 2)], axis=1)
    return mx.reshape(blocks, (count, nb, size))


def from_planes(p: Array, start: int = 0, stop: int | None = None) -> Array:
    """Rows start..stop of planes p [N, NB, 210] (`to_planes`) as Q6_K blocks [stop - start, NB, 210],
    the file's layout."""
    stop = p.shape[0] if stop is None else stop
    return _rows_as_blocks(p, lambda rows: rows[start:stop], stop - start)


def take_planes(p: Array, ids: Array) -> Array:
    """Rows `ids` (int [T]) of Q6_K planes p [N, NB, 210] as Q6_K blocks [T, NB, 210] (MLX ops)."""
    return _rows_as_blocks(p, lambda rows: mx.take(rows, ids, axis=0), ids.shape[0])


def lookup_planes(p: Array, ids: Array, dtype: Any) -> Array:
    """Rows `ids` (int32 [T]) of Q6_K planes p [N, NB, 210] -> [T, NB * 256] of `dtype` through the
    CUDA kernel: `dequantize(take_planes(p, ids))`'s values, in one kernel."""
    nb = p.shape[1]
    (out,) = _cuda_lookup_planes()([p, ids], output_shapes=[(ids.shape[0], nb * QK_K)], output_dtypes=[dtype],
                                   grid=(ids.shape[0] * nb * 32, 1, 1), threadgroup=(THREADS, 1, 1),
                                   template=[("T", dtype)])
    return out


def planes_lookup_ready(dtype: Any) -> bool:
    """Whether `lookup_planes` serves rows of `dtype` here (checked now, the first time, against the
    block kernel's dequantization of the same rows, bit for bit): only then do token embeddings take
    the planes (`gguf_layers.use_planes`, at load) and prefill chunks read their rows with it; else
    those rows are read back into blocks first."""
    if not planes_ready(dtype):
        return False
    return planes_checks.verdict(("cuda", "lookup", str(dtype)), lambda: _compare_planes_lookup(dtype))


def planes_ready(dtype: Any) -> bool:
    """Whether the CUDA Q6_K planes kernel serves x of `dtype` here: on CUDA, once `_compare_planes`
    passed for `dtype` (run now, the first time) and the file-layout kernel passed its own check."""
    if ready(QType.Q6_K, dtype) != "cuda":
        return False
    return planes_checks.verdict(("cuda", "matvec", str(dtype)), lambda: _compare_planes(dtype))


# ---------------------------------------------------------------------------------------- checked once

checks = CheckedOnce("pymlxc's kernels for GGUF Q2_K/Q3_K/Q6_K blocks")
planes_checks = CheckedOnce("pymlxc's kernels for Q6_K planes", fallback="the file's block layout")


def ready(qtype: QType, dtype: Any) -> str | None:
    """The kernel kind to use for `qtype` blocks and x of `dtype` on this device: "cuda" or
    "metal" once `compare` passed for them (run now, the first time), else None (MLX ops)."""
    kind = device_kind()
    if kind is None or dtype not in FLOAT_TYPES:
        return None
    # One verdict per type and dtype. The model's dtype is checked at load (`use_block_layers`): a
    # first check in the middle of a generation ran on the decode thread, where it failed on the H100
    # ("There is no Stream(gpu, 1) in current thread") and left the layers on MLX ops. Only that
    # dtype: every template a check runs is compiled first (NVRTC, a second or more each on a fresh
    # H100), and a model computes in one dtype.
    ok = checks.verdict((kind, int(qtype), str(dtype)), lambda: _compare(kind, qtype, dtype))
    return kind if ok else None


def random_blocks(rng: np.random.Generator, shape: tuple[int, ...], qtype: QType, scale: float = 0.02) -> np.ndarray:
    """Random valid blocks [*shape, S] uint8 of `qtype`: random bytes, with the float16 super-block
    scales set to finite values near `scale` (random bytes would hold NaN and huge ones)."""
    size = GGML_QUANT_SIZES[qtype][1]
    b = rng.integers(0, 256, (*shape, size), dtype=np.uint8)
    fields = {QType.Q6_K: (208,), QType.Q3_K: (108,), QType.Q2_K: (80, 82)}[qtype]
    for at in fields:
        d = (rng.uniform(0.25, 1.0, shape) * scale * rng.choice([-1, 1], shape)).astype(np.float16)
        b[..., at:at + 2] = d[..., None].view(np.uint8).reshape(*shape, 2)
    return b


def _compare(kind: str, qtype: QType, dtype: Any) -> str | None:
    """None where both kernels agree with MLX ops on random blocks (the dequantization bit for bit in
    float32, the product within float32 summation error plus `dtype`'s output rounding), else why not.
    Raises where a kernel cannot run here."""
    rng = np.random.default_rng(0)
    # N not a multiple of the rows per thread block; two matrices, three pairs; 9 blocks a row, so
    # that the Q6_K kernel's warps (up to 4, each 4 blocks a step) split rows unevenly.
    n, nb, m, e = 37, 9, 1, 2
    blocks = mx.array(random_blocks(rng, (e, n, nb), qtype))
    x = mx.array(rng.standard_normal((3, m, nb * QK_K)).astype(np.float32)).astype(dtype)
    idx = mx.array(np.array([1, 0, 1], np.int32))
    got_w = np.asarray(dequantize(mx.reshape(blocks, (e * n, nb, -1)), qtype, mx.float32, kind))
    forms: list[int | None] = [1, 2, 4] if kind == "cuda" and qtype == QType.Q6_K else [None]  # warps
    gots = [np.asarray(matvec(x, blocks, idx, qtype, kind, warps=f).astype(mx.float32)) for f in forms]
    want_w = np.asarray(dequantize_blocks(blocks, qtype)).reshape(e * n, -1)
    if not np.array_equal(got_w, want_w):
        bad = np.argwhere(got_w != want_w)[0]
        return f"{kind} dequantization of {qtype.name} differs from MLX ops at row {bad[0]}, value {bad[1]}"
    dense = want_w.reshape(e, n, -1)[np.asarray(idx)].astype(np.float64)
    xf = np.asarray(x.astype(mx.float32)).astype(np.float64)
    want = np.einsum("pmk,pnk->pmn", xf, dense)
    bound = np.einsum("pmk,pnk->pmn", np.abs(xf), np.abs(dense))
    tol = (bound * 2.0 ** -20 + np.abs(want) * (2.0 ** -7 if dtype.size == 2 else 2.0 ** -22) + 1e-30
           + x_rounding_bound(kind, qtype, dtype.size, xf, dense))
    for form, got in zip(forms, gots, strict=True):
        if not np.all(np.abs(got - want) <= tol):
            return (f"{kind} matvec of {qtype.name} with {dtype} x (warps {form}) differs from MLX ops by "
                    f"{float(np.max(np.abs(got - want) - tol)):.3g} beyond its bound")
    return None


def _same_bits(got: Array, want: Array) -> bool:
    """Equal values bit for bit (through float32: NumPy has no bfloat16; as bits, so -0 and 0 differ)."""
    return np.array_equal(np.asarray(got.astype(mx.float32)).view(np.uint32),
                          np.asarray(want.astype(mx.float32)).view(np.uint32))


def _compare_planes_lookup(dtype: Any) -> str | None:
    """None where `lookup_planes` of repeated and out-of-order ids (an embedding's lookup) and of a
    range of rows (a prefill chunk's) in `dtype` is the block kernel's dequantization of `take` of
    the same rows, bit for bit; else why not."""
    rng = np.random.default_rng(3)
    n, nb = 37, 3
    blocks = mx.array(random_blocks(rng, (n, nb), QType.Q6_K))
    planes = to_planes(blocks)
    for ids in (mx.array(np.array([5, 0, 36, 5, 17], np.int32)), mx.arange(5, 11, dtype=mx.int32)):
        if not np.array_equal(np.asarray(take_planes(planes, ids)), np.asarray(mx.take(blocks, ids, axis=0))):
            return "rows taken from the Q6_K planes are not those of the blocks"
        want = dequantize(mx.take(blocks, ids, axis=0), QType.Q6_K, dtype, "cuda")
        if not _same_bits(lookup_planes(planes, ids, dtype), want):
            return f"the Q6_K planes lookup of rows {np.asarray(ids).tolist()} differs from the blocks' ({dtype})"
    return None


def _compare_planes(dtype: Any) -> str | None:
    """None where `from_planes(to_planes(w))` is w and the planes kernel gives the file-layout
    kernel's values bit for bit (the same lanes, products and sums), for x of `dtype`, 1 and 8 rows
    of x and each warp split; else why not. (Each is a template NVRTC compiles on a machine's
    first load: the tests cover more row counts.)"""
    rng = np.random.default_rng(1)
    n, nb = 37, 9  # rows not a multiple of a block's; 9 blocks, so that the warps split rows unevenly
    blocks = mx.array(random_blocks(rng, (n, nb), QType.Q6_K))
    planes = to_planes(blocks)
    if not np.array_equal(np.asarray(from_planes(planes)), np.asarray(blocks)):
        return "the Q6_K planes do not give back the blocks"
    if not np.array_equal(np.asarray(from_planes(planes, 5, 11)), np.asarray(blocks[5:11])):
        return "rows 5..11 of the Q6_K planes are not those of the blocks"
    idx = mx.zeros((3,), mx.int32)
    for m in (1, MAX_X_ROWS):  # the two templates of q6k_rows (4 rows a warp, 2)
        x = mx.array(rng.standard_normal((3, m, nb * QK_K)).astype(np.float32)).astype(dtype)
        for warps in (1, 2, 4):
            want = matvec(x, mx.expand_dims(blocks, 0), idx, QType.Q6_K, "cuda", warps=warps)
            got = matvec(x, mx.expand_dims(planes, 0), idx, QType.Q6_K, "cuda", warps=warps, planes=True)
            if not _same_bits(got, want):
                return (f"the Q6_K planes kernel differs from the file-layout kernel ({dtype} x, {m} rows, "
                        f"warps {warps})")
    return None


__all__ = ["MAX_X_ROWS", "Q6K_SIZE", "TYPE_IDS", "checks", "dequantize", "device_kind",
           "from_planes", "lookup_planes", "matvec", "planes_checks", "planes_lookup_ready",
           "planes_ready", "q6k_rounding_step", "random_blocks", "ready", "take_planes", "to_planes",
           "x_rounding_bound"]
