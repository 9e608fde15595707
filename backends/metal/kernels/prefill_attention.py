"""Causal attention of a prompt chunk over its cache as one CUDA kernel, for chunks whose queries
times keys stay small (`MAX_PAIRS`).

MLX's CUDA attention of more than one query runs cuDNN's fused attention, whose graph cuDNN builds
for each shape of q, keys and values it meets (MLX keeps 256 built graphs). On an H200 that build took
42-44 ms for each new prompt length (`benchmarks/profile/probe_prefill.py --attention-ab`), where the
whole 128-token prefill of Llama-3.2-1B takes 8-10 ms: a chat's every turn, a server's every
request, meets a new pair of chunk and cache lengths and paid it. This kernel is compiled once per
head size, heads and type (and kept on disk with MLX's other kernels), and runs any lengths.

It is a flash-attention loop on the CUDA cores: a block of 4 warps takes one key/value head and
`QV` query vectors (the head's `HQ / HKV` query heads at `QV * HKV / HQ` consecutive positions;
`vectors`),
held in shared memory scaled by the scale's log2 e; for each tile of 32 keys (keys and values staged
in shared memory as float32) lane j scores key j against each of its warp's vectors, the warp keeps
each vector's running maximum and sum (exp2, float32) and each lane accumulates its 1 / 32 of every
output row. Keys past a query's position (`T - L + i` for query i of L over T keys: the causal
mask aligned at the bottom right, as MLX's `mask="causal"`) score minus infinity. The output is
written as [B, L, HQ, D], the layout the output projection reads, and handed back transposed.
"""
from __future__ import annotations

from typing import Any

from pymlxc.core.cuda_kernel import float32_bits

NAME = "pymlxc_prefill_attention"
INPUTS = ("q", "keys", "values")
OUTPUT_NAMES = ("out",)
THREADS = 128  # 4 warps
HEAD_DIMS = (64, 128)
# The largest chunk length times key count the kernel takes: its CUDA-core loop costs about as much
# as cuDNN's tensor cores for a 128-token chunk over 128 keys, and grows with the pairs; beyond
# this the per-shape build is a smaller share of the chunk's time.
MAX_PAIRS = 1 << 18
LOG2E = 1.4426950408889634

SOURCE = r"""
  constexpr int REP = HQ / HKV;
  constexpr int P = QV / REP;       // positions a block takes
  constexpr int VPW = QV / 4;       // query vectors a warp takes
  constexpr int VPT = D / 32;       // output elements a lane keeps per vector
  __shared__ float ks[32][D + 1];   // padded: lane j reads row j
  __shared__ float vs[32][D];
  __shared__ float qs[QV][D];
  __shared__ float ps[4][32];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int w = tid >> 5;
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
  const float sl = __int_as_float(SCALE_LOG2_BITS);
  for (int e = tid; e < QV * D; e += THREADS_) {
    const int v = e / D, d = e % D, pos = p0 + v / REP;
    float x = 0.f;
    if (pos < L) {
      x = sl * static_cast<float>(q[b * q_strides[0] + (h * REP + v % REP) * q_strides[1] +
                                    pos * q_strides[2] + d * q_strides[3]]);
    }
    qs[v][d] = x;
  }
  float m[VPW], l[VPW], o[VPW][VPT];
  int lim[VPW];
#pragma unroll
  for (int u = 0; u < VPW; ++u) {
    m[u] = Limits<float>::finite_min();
    l[u] = 0.f;
    lim[u] = off + p0 + (w * VPW + u) / REP;  // the last key this vector sees
#pragma unroll
    for (int t = 0; t < VPT; ++t) o[u][t] = 0.f;
  }
  const int kend = min(off + min(p0 + P, L), TK);
  const T* kb = keys + b * keys_strides[0] + h * keys_strides[1];
  const T* vb = values + b * values_strides[0] + h * values_strides[1];
  for (int k0 = 0; k0 < kend; k0 += 32) {
    __syncthreads();
    for (int e = tid; e < 32 * D; e += THREADS_) {
      const int j = e / D, d = e % D, key = k0 + j;
      float kx = 0.f, vx = 0.f;
      if (key < TK) {
        kx = static_cast<float>(kb[key * keys_strides[2] + d * keys_strides[3]]);
        vx = static_cast<float>(vb[key * values_strides[2] + d * values_strides[3]]);
      }
      ks[j][d] = kx;
      vs[j][d] = vx;
    }
    __syncthreads();
    float s[VPW];
#pragma unroll
    for (int u = 0; u < VPW; ++u) s[u] = 0.f;
#pragma unroll 8
    for (int d = 0; d < D; ++d) {
      const float kd = ks[lane][d];
#pragma unroll
      for (int u = 0; u < VPW; ++u) s[u] += qs[w * VPW + u][d] * kd;
    }
    const int key = k0 + lane;
#pragma unroll
    for (int u = 0; u < VPW; ++u) {
      if (k0 > lim[u]) continue;  // every key of the tile past this vector (the warp agrees)
      const float sc = key <= lim[u] ? s[u] : -INFINITY;
      float mx_ = sc;
#pragma unroll
      for (int sh = 16; sh > 0; sh >>= 1) mx_ = fmaxf(mx_, __shfl_xor_sync(0xffffffffu, mx_, sh));
      const float nm = fmaxf(m[u], mx_);
      const float f = exp2f(m[u] - nm);
      const float p = exp2f(sc - nm);
      float sum = p;
#pragma unroll
      for (int sh = 16; sh > 0; sh >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, sh);
      l[u] = l[u] * f + sum;
      m[u] = nm;
      ps[w][lane] = p;
      __syncwarp();
#pragma unroll
      for (int t = 0; t < VPT; ++t) {
        float acc = o[u][t] * f;
#pragma unroll 8
        for (int j = 0; j < 32; ++j) acc += ps[w][j] * vs[j][lane + 32 * t];
        o[u][t] = acc;
      }
      __syncwarp();
    }
  }
#pragma unroll
  for (int u = 0; u < VPW; ++u) {
    const int v = w * VPW + u, pos = p0 + v / REP;
    if (pos < L) {
      const float inv = 1.f / l[u];
      T* dst = out + ((static_cast<int64_t>(b) * L + pos) * HQ + h * REP + v % REP) * D;
#pragma unroll
      for (int t = 0; t < VPT; ++t) dst[lane + 32 * t] = static_cast<T>(o[u][t] * inv);
    }
  }
""".replace("THREADS_", str(THREADS))


# Query heads a key/value head may serve (a block holds every one of them at its positions).
GROUPS = (1, 2, 4, 8, 16, 32)


def vectors(group: int) -> int:
    """Query vectors a block takes: two a warp, or the group's heads at one position. Few vectors a
    block make many blocks: with 32 (8 positions of Llama's 4-head groups) a 128-token chunk of
    Llama-3.2-1B made 128 blocks of 4 warps, one a multiprocessor, and the kernel waited on its own
    shared-memory loads (on an H200 the prefill took 0.8 ms longer than with cuDNN's attention)."""
    return max(8, group)


def applies(q_len: int, kv_len: int, heads: int, kv_heads: int, head_dim: int, dtype_size: int) -> bool:
    """Whether the kernel takes a chunk of `q_len` queries over `kv_len` keys (the chunk's own last):
    2-byte floats, a head size it knows, query heads a group of GROUPS per key/value head (at most 16
    at head size 128, the block's shared memory), and at most MAX_PAIRS query-key pairs."""
    if not (2 <= q_len <= kv_len and q_len * kv_len <= MAX_PAIRS and head_dim in HEAD_DIMS and dtype_size == 2
            and kv_heads > 0 and heads % kv_heads == 0):
        return False
    group = heads // kv_heads
    return group in GROUPS and vectors(group) * head_dim <= 2048


def launch(batch: int, q_len: int, heads: int, kv_heads: int, head_dim: int, dtype: Any, scale: float
           ) -> dict[str, Any]:
    """Keyword arguments of a kernel call: grid, threads, template."""
    qv = vectors(heads // kv_heads)
    positions = qv // (heads // kv_heads)
    blocks = batch * kv_heads * -(-q_len // positions)
    return {
        "grid": (blocks * THREADS, 1, 1),
        "threadgroup": (THREADS, 1, 1),
        "template": [("T", dtype), ("D", head_dim), ("HQ", heads), ("HKV", kv_heads), ("QV", qv),
                     ("SCALE_LOG2_BITS", float32_bits(scale * LOG2E))],
    }
