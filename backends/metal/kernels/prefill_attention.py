"""Causal attention of a prompt chunk over its cache as one CUDA kernel, for chunks whose queries
times keys stay below MAX_PAIRS.

MLX's CUDA attention of more than one query runs cuDNN's fused attention, whose graph MLX builds for
each shape of q, keys and values it meets (256 kept). On an H200 one attention at a new length took
42-44 ms, and Llama-3.2-1B's time to the first token of a prompt of a new length 48-75 ms against
9-10 ms at a length run before (`benchmarks/profile/probe_prefill.py --attention-ab`): a chat's
every turn, a server's every request, meets a new pair of chunk and cache lengths. This kernel is
compiled once per head size, heads and type (MLX keeps its PTX on disk) and runs any lengths.

It is a flash-attention loop on tensor cores (`mma.sync` m16n8k16, float32 accumulators): a block of
4 warps takes one key/value head and 64 query vectors, the head's group of query heads at 64 // group
consecutive positions (the rest left empty), 16 rows a warp held as mma operands in registers. For
each tile of 64 keys, staged in shared memory (16-byte loads where the rows allow them, else element
by element through the strides: q may be a view of joint heads, the keys and values views of the
cache's buffers), a warp forms its 16 x 64 scores, masks keys past each query (`T - L + i` for query
i of L over T keys: the causal mask aligned at the bottom right, as MLX's `mask="causal"`), updates
each row's running maximum and sum (exp2, float32) and adds the probabilities, rounded to the 2-byte
type as flash attention rounds them for the second product, times the values' tile (`ldmatrix.trans`
fragments). The output is written as [B, L, HQ, D], the layout the output projection reads, and
handed back transposed.

A second form (`PADDED_NAME`) takes left-padded rows, as the server's grouped prefill holds them: an
int32 `starts` [B], row b's first real key; a query sees the keys the causal mask leaves it from
`starts[b]` on, and itself (a padded query sees only itself: MLX's boolean mask of
`generate.left_padded_mask`, which keeps such rows finite). Scores of hidden keys are -inf before the
running maximum, which starts at the float's finite minimum: a tile with nothing to see adds zeros.
"""
from __future__ import annotations

from typing import Any

from pymlxc.core.cuda_kernel import float32_bits

from . import qmm

NAME = "pymlxc_prefill_attention"
INPUTS = ("q", "keys", "values")
PADDED_NAME = "pymlxc_prefill_attention_padded"
PADDED_INPUTS = (*INPUTS, "starts")
OUTPUT_NAMES = ("out",)
THREADS = 128  # 4 warps
VECTORS = 64  # query vectors a block takes, 16 a warp: whole groups of query heads, up to 64 a group
HEAD_DIMS = (64, 80, 96, 112, 128)  # multiples of the mma's 16; two 64-key tiles fit the shared memory
# The largest chunk length times key count the kernel takes (1024 tokens over 1024 keys, 128 over
# 8192): beyond it the per-shape build is a small share of a chunk's time.
MAX_PAIRS = 1 << 20
LOG2E = 1.4426950408889634

HEADER = qmm.HEADER + r"""
namespace pymlxc_attn {

// Four 8 x 8 matrices of 2-byte values from shared memory, each transposed: lane i names row i % 8
// of matrix i / 8, and a thread gets two elements of one column.
__device__ __forceinline__ void ldmatrix4_trans(unsigned* r, const void* p) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

// A row of a [.., rows, D] tensor into shared memory at `dst`, 8 values a call: the eight-value
// piece `c`: one 16-byte load where the tensor's rows allow it (`wide`), else eight.
template <typename T>
__device__ __forceinline__ void copy8(T* dst, const T* row, int64_t step, int c, bool valid, bool wide) {
  if (!valid) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
  } else if (wide) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(row + 8 * c);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) dst[i] = row[(8 * c + i) * step];
  }
}

}  // namespace pymlxc_attn
"""

# Template arguments: T (q, keys, values, output), D (head size), HQ and HKV (query and key/value
# heads), SCALE_LOG2_BITS (float32 bits of the scale times log2 e). q [B, HQ, L, D], keys and values
# [B, HKV, T, D] through their strides; out [B, L, HQ, D] row-major.
SOURCE = r"""
  constexpr int REP = HQ / HKV;
  constexpr int BM = VECTORS_;       // query vectors a block takes: 16 a warp (staged in ks: BM <= BN)
  constexpr int P = BM / REP;        // their positions (vectors P * REP .. 63 are left empty)
  constexpr int BN = 64;             // keys a tile
  constexpr int LD = D + 8;          // padded row: ldmatrix without bank conflicts
  constexpr int KS = D / 16;         // k-steps of q k^T
  __shared__ __align__(16) T ks[BN * LD];
  __shared__ __align__(16) T vs[BN * LD];
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int L = q_shape[2];
  const int TK = keys_shape[2];
  const int tiles = (L + P - 1) / P;
  int blk = blockIdx.x;
  const int pt = blk % tiles;
  blk /= tiles;
  const int h = blk % HKV;
  const int b = blk / HKV;
  const int p0 = pt * P;
  const int off = TK - L;
  const int start = PADDED_START;  // row b's first real key (the padded form's `starts`; else 0)
  const float sl = __int_as_float(SCALE_LOG2_BITS);
  auto wide = [](const T* base, int64_t s2, int64_t s3) {
    return s3 == 1 && (s2 % 8) == 0 && (reinterpret_cast<unsigned long long>(base) & 15ull) == 0;
  };
  const T* qb = q + b * q_strides[0];
  const T* kb = keys + b * keys_strides[0] + h * keys_strides[1];
  const T* vb = values + b * values_strides[0] + h * values_strides[1];
  const bool qw = wide(qb, q_strides[2], q_strides[3]) && (q_strides[1] % 8) == 0;
  const bool kw = wide(kb, keys_strides[2], keys_strides[3]);
  const bool vw = wide(vb, values_strides[2], values_strides[3]);

  // The block's query vectors (vector r: position p0 + r / REP, head h * REP + r % REP) through ks,
  // then each warp's 16 as mma A fragments in registers.
  for (int e = tid; e < BM * D / 8; e += THREADS_) {
    const int r = e / (D / 8), c = e % (D / 8), pos = p0 + r / REP;
    const T* row = qb + (h * REP + r % REP) * q_strides[1] + static_cast<int64_t>(min(pos, L - 1)) * q_strides[2];
    pymlxc_attn::copy8<T>(ks + r * LD + 8 * c, row, q_strides[3], c, pos < L && r < P * REP, qw);
  }
  __syncthreads();
  unsigned qa[KS][4];
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
    pymlxc_qmm::ldmatrix4(qa[kk], ks + (16 * w + (lane & 15)) * LD + 16 * kk + (lane >> 4) * 8);

  // Rows g and g + 8 of the warp's 16: their last visible key (the causal mask, bottom-right).
  int lim[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) lim[i] = min(off + p0 + (16 * w + g + 8 * i) / REP, TK - 1);
  const int warp_lim = min(off + p0 + min((16 * w + 15) / REP, P - 1), TK - 1);
  float m[2] = {Limits<float>::finite_min(), Limits<float>::finite_min()};
  float l[2] = {0.f, 0.f};  // this thread's part of each row's sum (the quad's four add up at the end)
  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = 0.f;

  const int kend = min(off + min(p0 + P, L), TK);
  for (int k0 = 0; k0 < kend; k0 += BN) {
    __syncthreads();  // the tiles before (and the queries, the first time) are read
    for (int e = tid; e < BN * D / 8; e += THREADS_) {
      const int j = e / (D / 8), c = e % (D / 8), key = k0 + j;
      const int64_t at = static_cast<int64_t>(min(key, TK - 1));
      pymlxc_attn::copy8<T>(ks + j * LD + 8 * c, kb + at * keys_strides[2], keys_strides[3], c, key < TK, kw);
      pymlxc_attn::copy8<T>(vs + j * LD + 8 * c, vb + at * values_strides[2], values_strides[3], c, key < TK, vw);
    }
    __syncthreads();
    if (k0 > warp_lim) continue;  // every key of the tile past the warp's rows
    // S = q k^T: 8 tiles of 16 x 8 (keys k0 + 8 j ..).
    float s[BN / 8][4];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
      for (int jj = 0; jj < BN / 16; ++jj) {
        unsigned bf[4];
        pymlxc_qmm::ldmatrix4(bf, ks + (16 * jj + (lane & 7) + ((lane >> 4) << 3)) * LD + 16 * kk +
                                      ((lane >> 3) & 1) * 8);
        pymlxc_qmm::Mma<T>::run(s[2 * jj], qa[kk], bf[0], bf[1]);
        pymlxc_qmm::Mma<T>::run(s[2 * jj + 1], qa[kk], bf[2], bf[3]);
      }
    }
    // The online softmax of rows g (elements 0, 1) and g + 8 (2, 3), in exp2.
    float mx_[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + 8 * j + 2 * t + (e & 1);
        const bool seen = key <= lim[e >> 1] && (!PADDED_ || key >= start || key == lim[e >> 1]);
        const float v = seen ? s[j][e] * sl : -INFINITY;
        s[j][e] = v;
        mx_[e >> 1] = fmaxf(mx_[e >> 1], v);
      }
    float f[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx_[i] = fmaxf(mx_[i], __shfl_xor_sync(0xffffffffu, mx_[i], 1));
      mx_[i] = fmaxf(mx_[i], __shfl_xor_sync(0xffffffffu, mx_[i], 2));
      const float nm = fmaxf(m[i], mx_[i]);
      f[i] = exp2f(m[i] - nm);
      m[i] = nm;
      l[i] *= f[i];
    }
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = exp2f(s[j][e] - m[e >> 1]);
        s[j][e] = p;
        l[e >> 1] += p;
      }
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o[j][0] *= f[0];
      o[j][1] *= f[0];
      o[j][2] *= f[1];
      o[j][3] *= f[1];
    }
    // O += P V: P's 16 x 16 A fragments from S's accumulators, V's B fragments transposed.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      unsigned pa[4];
      pa[0] = pymlxc_attn::pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      pa[1] = pymlxc_attn::pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      pa[2] = pymlxc_attn::pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[3] = pymlxc_attn::pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int jj = 0; jj < D / 16; ++jj) {
        unsigned bf[4];
        pymlxc_attn::ldmatrix4_trans(bf, vs + (16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + 16 * jj +
                                             (lane >> 4) * 8);
        pymlxc_qmm::Mma<T>::run(o[2 * jj], pa, bf[0], bf[1]);
        pymlxc_qmm::Mma<T>::run(o[2 * jj + 1], pa, bf[2], bf[3]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = 16 * w + g + 8 * i, pos = p0 + r / REP;
    if (pos < L && r < P * REP) {
      const float inv = 1.f / l[i];
      T* dst = out + ((static_cast<int64_t>(b) * L + pos) * HQ + h * REP + r % REP) * D;
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        *reinterpret_cast<unsigned*>(dst + 8 * j + 2 * t) =
            pymlxc_attn::pack2<T>(o[j][2 * i] * inv, o[j][2 * i + 1] * inv);
    }
  }
""".replace("THREADS_", str(THREADS)).replace("VECTORS_", str(VECTORS))
# The padded form: the same source reading `starts`.
PADDED_SOURCE = SOURCE.replace("PADDED_START", "starts[b]").replace("PADDED_", "true")
SOURCE = SOURCE.replace("PADDED_START", "0").replace("PADDED_", "false")


def applies(q_len: int, kv_len: int, heads: int, kv_heads: int, head_dim: int, dtype_size: int) -> bool:
    """Whether the kernel takes a chunk of `q_len` queries over `kv_len` keys (the chunk's own last):
    2-byte floats, a head size it knows, groups of at most VECTORS query heads a key/value head, and
    at most MAX_PAIRS query-key pairs."""
    return (2 <= q_len <= kv_len and q_len * kv_len <= MAX_PAIRS and head_dim in HEAD_DIMS and dtype_size == 2
            and kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads <= VECTORS)


def launch(batch: int, q_len: int, heads: int, kv_heads: int, head_dim: int, dtype: Any, scale: float
           ) -> dict[str, Any]:
    """Keyword arguments of a kernel call: grid, threads, template."""
    positions = VECTORS // (heads // kv_heads)
    blocks = batch * kv_heads * -(-q_len // positions)
    return {
        "grid": (blocks * THREADS, 1, 1),
        "threadgroup": (THREADS, 1, 1),
        "template": [("T", dtype), ("D", head_dim), ("HQ", heads), ("HKV", kv_heads),
                     ("SCALE_LOG2_BITS", float32_bits(scale * LOG2E))],
    }
