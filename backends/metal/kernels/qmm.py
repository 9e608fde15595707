"""A 4-bit quantized matrix product on tensor cores for CUDA: `x @ dequantize(w).T` for a prompt
chunk's rows of x (prefill), where `matvec.py` takes a few rows.

MLX's CUDA `quantized_matmul` of 128 rows took 64 us for Llama-3.2-1B's gate/up weights at group 64
and 95 us at group 32, GGUF's Q4_0 and Q4_K (H100, `benchmarks/profile/probe_qmm.py`). At 128 rows a
4-bit weight (half a byte) serves 128 multiply-adds, so the product can be bound by the tensor cores
rather than the weight bytes; this kernel spends the dequantization once per weight and thread block,
out of the inner loop:

    a thread block of 128 threads (4 warps) computes a 64 x 128 tile of the output;
    per step of 64 along K it takes x's 64 x 64 tile and the weights' 128 x 64 tile (one row and
    two 16-byte loads of packed weights per thread), writes the weights dequantized into shared
    memory (scale * q + bias as one fused multiply-add of x's 2-byte dtype, two weights an
    instruction, the codes made floats through the mantissa), and each warp
    multiplies its 32 x 64 part with `mma.sync` m16n8k16 (float32 accumulators), its operands read
    with `ldmatrix`. Loads run two steps ahead: x's tiles by `cp.async` into three shared stages,
    the packed weights into two sets of registers.

The group size is any of 32, 64, 128: a thread's 32 consecutive weights lie in one group. The
layout is MLX's affine quantization, as in `matvec.py`.

This module holds only the source and the launch geometry; `kernel_choice.py` applies it.
"""
from __future__ import annotations

from typing import Any

NAME = "pymlxc_qmm4"
INPUTS = ("x", "w", "scales", "biases")
OUTPUT_NAMES = ("out",)
THREADS = 128
TILE_M, TILE_N, TILE_K = 64, 128, 64
GROUP_SIZES = (32, 64, 128)

HEADER = r"""
namespace pymlxc_qmm {

template <typename T> struct Mma;

// c += a b: one mma.sync m16n8k16 over operands of the 2-byte type TY ("f16" or "bf16"), A in rows and
// B in columns, float32 accumulators.
#define pymlxc_qmm_run(TY)                                                                          \
  __device__ static __forceinline__ void run(float* c, const unsigned* a, unsigned b0, unsigned b1) { \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, "          \
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                          \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                   \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                   \
  }

template <> struct Mma<__half> {
  pymlxc_qmm_run("f16")
  // Two codes q (0..15, one in the low 4 bits of each half) to scale * q + bias: a code placed in
  // the mantissa of 1024.0 is the half 1024 + q, exactly.
  __device__ static __forceinline__ unsigned dequant2(unsigned codes, unsigned scale2, unsigned bias2) {
    const unsigned magic = 0x64006400u, placed = codes | magic;
    const __half2 q = __hsub2(*reinterpret_cast<const __half2*>(&placed), *reinterpret_cast<const __half2*>(&magic));
    __half2 w = __hfma2(q, *reinterpret_cast<const __half2*>(&scale2), *reinterpret_cast<const __half2*>(&bias2));
    return *reinterpret_cast<unsigned*>(&w);
  }
  __device__ static __forceinline__ unsigned splat(__half v) {
    __half2 h = __half2half2(v);
    return *reinterpret_cast<unsigned*>(&h);
  }
};

template <> struct Mma<__nv_bfloat16> {
  pymlxc_qmm_run("bf16")
  // As for half, with 128.0, whose bfloat16 mantissa holds q exactly.
  __device__ static __forceinline__ unsigned dequant2(unsigned codes, unsigned scale2, unsigned bias2) {
    const unsigned magic = 0x43004300u, placed = codes | magic;
    const __nv_bfloat162 q = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&placed),
                                     *reinterpret_cast<const __nv_bfloat162*>(&magic));
    __nv_bfloat162 w = __hfma2(q, *reinterpret_cast<const __nv_bfloat162*>(&scale2),
                               *reinterpret_cast<const __nv_bfloat162*>(&bias2));
    return *reinterpret_cast<unsigned*>(&w);
  }
  __device__ static __forceinline__ unsigned splat(__nv_bfloat16 v) {
    __nv_bfloat162 h = __bfloat162bfloat162(v);
    return *reinterpret_cast<unsigned*>(&h);
  }
};

#undef pymlxc_qmm_run

// Four 8 x 8 matrices of 2-byte values from shared memory; lane i names row i % 8 of matrix i / 8.
__device__ __forceinline__ void ldmatrix4(unsigned* r, const void* p) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// The 8 weights of a packed word (element i in bits 4i..4i+3) dequantized, as 4 pairs in order.
// A byte permute spreads bytes 0 and 1 (elements 0-3) into the two halves; the low nibbles are
// then elements 0 and 2, the high ones 1 and 3, and a second permute puts each pair in order.
template <typename T>
__device__ __forceinline__ void dequant8(unsigned word, unsigned scale2, unsigned bias2, unsigned* d) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const unsigned spread = __byte_perm(word, 0u, half ? 0x4342u : 0x4140u);
    const unsigned even = Mma<T>::dequant2(spread & 0x000F000Fu, scale2, bias2);
    const unsigned odd = Mma<T>::dequant2((spread >> 4) & 0x000F000Fu, scale2, bias2);
    d[2 * half] = __byte_perm(even, odd, 0x5410u);
    d[2 * half + 1] = __byte_perm(even, odd, 0x7632u);
  }
}

// A 16-byte copy from global to shared memory that does not hold a register; `valid` false fills
// the 16 bytes with zeros instead (rows of x past M).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(a), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

}  // namespace pymlxc_qmm
"""

# Template arguments: T (x, scales, biases and output dtype), G (group size).
SOURCE = r"""
  constexpr int BM = 64, BN = 128, BK = 64, LD = BK + 8;  // LD: padded row, ldmatrix without bank conflicts
  constexpr int STAGES = 3;  // x tiles in flight: this step's and the next two
  __shared__ __align__(16) T xs[STAGES * BM * LD];
  __shared__ __align__(16) T ws[BN * LD];
  const int M = x_shape[0];
  const int K = x_shape[1];
  const int N = w_shape[0];
  const int GROUPS = K / G;
  const int WORDS = K / 8;  // packed uint32 per weight row
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = (warp & 1) * 32, wn = (warp >> 1) * 64;  // the warp's part of the tile
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  const int first = 0, last = K / BK;  // the steps along K
  // This thread's weight row (rows past N read row N - 1; their sums are not written).
  const size_t wrow = static_cast<size_t>(min(n0 + tid, N - 1));
  const uint4* wp = reinterpret_cast<const uint4*>(w + wrow * WORDS);
  const T* sp = scales + wrow * GROUPS;
  const T* bp = biases + wrow * GROUPS;
  float acc[2][8][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  // x: step s's tile by cp.async into stage s % STAGES (rows past M filled with zeros).
  auto load_x = [&](int s) {
    T* dst = xs + (s % STAGES) * BM * LD;
    const int k0 = s * BK;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = tid + THREADS_ * i, r = idx >> 3, c = (idx & 7) * 8;
      const T* src = x + static_cast<size_t>(min(m0 + r, M - 1)) * K + k0 + c;
      pymlxc_qmm::cp_async16(dst + r * LD + c, src, m0 + r < M);
    }
  };
  // Weights: step s's 64 packed values of this thread's row, with their scales and biases, into
  // registers two steps ahead; they are first used (dequantized into ws) when their step comes.
  struct Fetched { uint4 q[2]; T sc[2], bi[2]; };
  auto load_w = [&](Fetched& f, int s) {
    const int k0 = s * BK;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      f.q[h] = wp[(k0 + 32 * h) / 32];
      f.sc[h] = sp[(k0 + 32 * h) / G];
      f.bi[h] = bp[(k0 + 32 * h) / G];
    }
  };
  auto store_w = [&](const Fetched& f) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const unsigned s2 = pymlxc_qmm::Mma<T>::splat(f.sc[h]), b2 = pymlxc_qmm::Mma<T>::splat(f.bi[h]);
      const unsigned q[4] = {f.q[h].x, f.q[h].y, f.q[h].z, f.q[h].w};
      unsigned d[16];
#pragma unroll
      for (int j = 0; j < 4; ++j) pymlxc_qmm::dequant8<T>(q[j], s2, b2, d + 4 * j);
      uint4* dst = reinterpret_cast<uint4*>(ws + tid * LD + 32 * h);
#pragma unroll
      for (int j = 0; j < 4; ++j) dst[j] = make_uint4(d[4 * j], d[4 * j + 1], d[4 * j + 2], d[4 * j + 3]);
    }
  };
  auto products = [&](int s) {
    const T* xt = xs + (s % STAGES) * BM * LD;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned a[2][4], b[4][4];
#pragma unroll
      for (int i = 0; i < 2; ++i)
        pymlxc_qmm::ldmatrix4(a[i], xt + (wm + 16 * i + (lane & 15)) * LD + kk + (lane >> 4) * 8);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        pymlxc_qmm::ldmatrix4(b[j], ws + (wn + 16 * j + (lane & 7) + ((lane >> 4) << 3)) * LD + kk +
                                        ((lane >> 3) & 1) * 8);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
          pymlxc_qmm::Mma<T>::run(acc[i][j], a[i], b[j >> 1][(j & 1) * 2], b[j >> 1][(j & 1) * 2 + 1]);
    }
  };
  // One step: its weights into ws, the loads of the step two ahead issued, its x tile awaited, the
  // products. The first barrier frees ws and the x stage about to be refilled (step s - 1's).
  auto step = [&](Fetched& f, int s) {
    __syncthreads();
    store_w(f);
    if (s + 2 < last) {
      load_x(s + 2);
      load_w(f, s + 2);
    }
    pymlxc_qmm::cp_async_commit();
    pymlxc_qmm::cp_async_wait<2>();  // step s's group is complete; s + 1 and s + 2 may be in flight
    __syncthreads();
    products(s);
  };

  Fetched fa, fb;
  if (first < last) {
    load_x(first);
    load_w(fa, first);
  }
  pymlxc_qmm::cp_async_commit();
  if (first + 1 < last) {
    load_x(first + 1);
    load_w(fb, first + 1);
  }
  pymlxc_qmm::cp_async_commit();
  for (int s = first; s < last; s += 2) {  // two steps a turn: each register set keeps its own names
    step(fa, s);
    if (s + 1 < last) step(fb, s + 1);
  }

  // Thread (g, t) of a warp holds rows g and g + 8, columns 2t and 2t + 1 of each 16 x 8 product.
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = m0 + wm + 16 * i + g + (e >> 1) * 8;
        const int col = n0 + wn + 8 * j + 2 * t + (e & 1);
        if (row < M && col < N) out[static_cast<size_t>(row) * N + col] = static_cast<T>(acc[i][j][e]);
      }
""".replace("THREADS_", str(THREADS))


def applies(x_rows: int, k: int, bits: int, group_size: int, dtype_size: int) -> bool:
    """Whether the kernel computes the product: 4-bit weights at a group size it takes, 2-byte
    floats, K a multiple of the tile's 64."""
    return bits == 4 and group_size in GROUP_SIZES and dtype_size == 2 and x_rows >= 1 and k % TILE_K == 0


def launch(m: int, k: int, n: int, dtype: Any, group_size: int) -> dict[str, Any]:
    """Keyword arguments of a kernel call for x (m, k) and weights of n rows: grid, threads, template."""
    return {
        "grid": (-(-n // TILE_N) * THREADS, -(-m // TILE_M), 1),
        "threadgroup": (THREADS, 1, 1),
        "template": [("T", dtype), ("G", group_size)],
    }
