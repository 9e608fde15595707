"""One token's attention over the first `pos + 1` keys of a decode buffer, the position read on the
device, as CUDA kernels: what lets a whole decode step be one compiled graph.

MLX's attention takes keys of an exact length, so the decode segments slice each layer's buffer to
`pos + 1` keys outside the compiled graph, and a step is 17 compiled calls and 48 operations built
from Python for Llama-3.2-1B. On an H100 that build took 0.9-1.3 ms a token against 1.1-1.5 ms for
MLX to encode the step (`benchmarks/profile/probe_host_split.py`), and by a py-spy profile the
evaluation thread spent about a fifth of its time waiting for the interpreter lock the building
thread held. These
kernels read the position from the int32 [4] the segments carry, so the whole step, attention
included, is traced once per buffer size and replayed with one call.

They reproduce MLX's own one-token kernels (`sdpa_vector`): up to 1024 keys one block of 32 warps
per query head (`kernel_sdpav_1pass`), above that 32 blocks of 8 warps per head and a second
kernel that merges them (`kernel_sdpav_2pass_1`, `_2`); the same threads, the same key order per
warp, the same warp reductions, the same exp2 arithmetic (including the scale's log2 e, which the
one-pass kernel rounds from double and the two-pass kernel multiplies in float). So a step on them
gives the tokens of a step on MLX's attention; `check()` runs them once per shape and type against
MLX's attention at lengths on both sides of 1024 and keeps MLX's attention where any bit differs.

The caller picks the kernel by the step's length (`one_pass(keys)`): a graph holds one kind, and
the decode traces one graph per kind.
"""
from __future__ import annotations

from typing import Any

import numpy as np

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core.cuda_kernel import SharedKernel, float32_bits

from .check import CheckedOnce

ONE_PASS_KEYS = 1024  # MLX's one-pass kernel up to this many keys, the two-pass pair above
BLOCKS = 32  # the two-pass kernel's blocks per head (MLX's)
LOG2E = 1.4426950408889634  # M_LOG2E

HEADER = r"""
#include <cooperative_groups/reduce.h>
"""

# Template arguments: T (the type of q, the buffers and the output), HQ and HKV (query and key/value
# heads), D (head size: 64, 96 or 128, values alike), SCALE_LOG2_BITS (float32 bits of the scale times
# log2 e, rounded as the MLX kernel being reproduced rounds it). Keys and values are read through
# their strides (a buffer [B, HKV, slots, D]); q and the output are row-major [B, HQ, 1, D].
COMMON = r"""
  namespace cg = cooperative_groups;
  constexpr int VPT = D / 32;
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane = warp.thread_rank();
  const int w = warp.meta_group_rank();
  const int kL = pos[0] + 1;
  const float scale_log2 = __int_as_float(SCALE_LOG2_BITS);
"""

# Both kernels' start: the query scaled by the scale's log2 e, the running output, max and sum.
_SCALED_Q = r"""
  float qv[VPT], kv[VPT], o[VPT];
#pragma unroll
  for (int i = 0; i < VPT; i++) qv[i] = scale_log2 * static_cast<float>(Q[VPT * lane + i]);
#pragma unroll
  for (int i = 0; i < VPT; i++) o[i] = 0.f;
  float max_score = Limits<float>::finite_min();
  float sum_exp_score = 0.f;
"""

# Both kernels' step over one key (after the loop's header, with its closing brace): the warp's
# score, MLX's online softmax update in exp2, the output accumulated; then the pointers move.
_KEY_LOOP = r"""
#pragma unroll
    for (int j = 0; j < VPT; j++) kv[j] = K[VPT * lane + j];
    float score = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; j++) score += qv[j] * kv[j];
    score = cg::reduce(warp, score, cg::plus<float>());
    float new_max = max(max_score, score);
    float factor = exp2f(max_score - new_max);
    float exp_score = exp2f(score - new_max);
    max_score = new_max;
    sum_exp_score = sum_exp_score * factor + exp_score;
#pragma unroll
    for (int j = 0; j < VPT; j++) o[j] = o[j] * factor + exp_score * static_cast<float>(V[VPT * lane + j]);
    K += k_step;
    V += v_step;
  }
"""

# The end of the one-pass kernel and of the second pass: warp w gathers element VPT * w + i of every
# lane's part (through shared memory), sums them scaled by each part's factor, divides by the sum of
# the exponentials and writes it.
_MERGE = r"""#pragma unroll
  for (int i = 0; i < VPT; i++) {
    outputs[lane][w] = o[i];
    block.sync();
    float ot = outputs[w][lane] * factor;
    o[i] = cg::reduce(warp, ot, cg::plus<float>()) * sum_exp_score;
    block.sync();
  }
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < VPT; i++) O[VPT * w + i] = static_cast<T>(o[i]);
  }
"""

# One block of 32 warps per (head, row); warp w takes keys w, w + 32, ...
ONE_PASS = COMMON + r"""
  constexpr int BN = 32;
  __shared__ float outputs[BN][33];
  __shared__ float max_scores[BN];
  __shared__ float sum_exp_scores[BN];
  const int b = blockIdx.z;
  const int head = blockIdx.x;
  const int kvh = head / (HQ / HKV);
  const T* Q = q + (static_cast<int64_t>(b) * HQ + head) * D;
  const T* K = keys + b * keys_strides[0] + kvh * keys_strides[1] + w * keys_strides[2];
  const T* V = values + b * values_strides[0] + kvh * values_strides[1] + w * values_strides[2];
  T* O = out + (static_cast<int64_t>(b) * HQ + head) * D;
  const int k_step = BN * static_cast<int>(keys_strides[2]);
  const int v_step = BN * static_cast<int>(values_strides[2]);
""" + _SCALED_Q + r"""  for (int i = w; i < kL; i += BN) {
""" + _KEY_LOOP + r"""  if (lane == 0) {
    max_scores[w] = max_score;
    sum_exp_scores[w] = sum_exp_score;
  }
  block.sync();
  max_score = max_scores[lane];
  float new_max = cg::reduce(warp, max_score, cg::greater<float>());
  float factor = exp2f(max_score - new_max);
  sum_exp_score = cg::reduce(warp, sum_exp_scores[lane] * factor, cg::plus<float>());
  sum_exp_score = sum_exp_score == 0 ? 0 : __frcp_rn(sum_exp_score);
""" + _MERGE

# First of two: BLOCKS blocks of 8 warps per (head, row); warp w of block k takes keys k * 8 + w,
# then every 256th; each block writes its partial output, its sum and its max (float32).
TWO_PASS_1 = COMMON + r"""
  constexpr int BN = 8;
  constexpr int NB = 32;
  __shared__ float outputs[BN][33];
  __shared__ float max_scores[BN];
  __shared__ float sum_exp_scores[BN];
  const int b = blockIdx.z / NB;
  const int part = blockIdx.z % NB;
  const int head = blockIdx.x;
  const int kvh = head / (HQ / HKV);
  const int first = part * BN + w;
  const T* Q = q + (static_cast<int64_t>(b) * HQ + head) * D;
  const T* K = keys + b * keys_strides[0] + kvh * keys_strides[1] + first * keys_strides[2];
  const T* V = values + b * values_strides[0] + kvh * values_strides[1] + first * values_strides[2];
  const int64_t p_offset = (static_cast<int64_t>(b) * HQ + head) * NB + part;
  float* P = partials + p_offset * D;
  const int k_step = NB * BN * static_cast<int>(keys_strides[2]);
  const int v_step = NB * BN * static_cast<int>(values_strides[2]);
""" + _SCALED_Q + r"""  for (int i = first; i < kL; i += NB * BN) {
""" + _KEY_LOOP + r"""  if (lane == 0) {
    max_scores[w] = max_score;
    sum_exp_scores[w] = sum_exp_score;
  }
  block.sync();
  max_score = (lane < BN) ? max_scores[lane] : -1e9;
  float new_max = cg::reduce(warp, max_score, cg::greater<float>());
  float factor = exp2f(max_score - new_max);
  sum_exp_score = (lane < BN) ? sum_exp_scores[lane] : 0.f;
  sum_exp_score = cg::reduce(warp, sum_exp_score * factor, cg::plus<float>());
  if (w == 0) {
    sums[p_offset] = sum_exp_score;
    maxs[p_offset] = new_max;
  }
  float ff = exp2f(max_scores[w] - new_max);
#pragma unroll
  for (int i = 0; i < VPT; i++) {
    outputs[w][lane] = o[i] * ff;
    block.sync();
    if (w == 0) {
      float ot = outputs[0][lane];
#pragma unroll
      for (int j = 1; j < BN; j++) {
        ot += outputs[j][lane];
        warp.sync();
      }
      o[i] = ot;
    }
    block.sync();
  }
  if (w == 0) {
#pragma unroll
    for (int i = 0; i < VPT; i++) P[VPT * lane + i] = o[i];
  }
"""

# Second of two: one block of 32 warps per (head, row) merges the 32 partial outputs.
TWO_PASS_2 = r"""
  namespace cg = cooperative_groups;
  constexpr int VPT = D / 32;
  constexpr int NB = 32;
  __shared__ float outputs[32][33];
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane = warp.thread_rank();
  const int w = warp.meta_group_rank();
  const int b = blockIdx.z;
  const int head = blockIdx.x;
  const int64_t p_offset = (static_cast<int64_t>(b) * HQ + head) * NB;
  const float* P = partials + p_offset * D + w * D;
  T* O = out + (static_cast<int64_t>(b) * HQ + head) * D;
  float o[VPT];
  float max_score = maxs[p_offset + lane];
  float new_max = cg::reduce(warp, max_score, cg::greater<float>());
  float factor = exp2f(max_score - new_max);
  float sum_exp_score = cg::reduce(warp, sums[p_offset + lane] * factor, cg::plus<float>());
  sum_exp_score = sum_exp_score == 0 ? 0 : __frcp_rn(sum_exp_score);
#pragma unroll
  for (int i = 0; i < VPT; i++) o[i] = P[VPT * lane + i];
""" + _MERGE

_one_pass = SharedKernel("pymlxc_decode_attention", ("q", "keys", "values", "pos"), ("out",), ONE_PASS,
                         HEADER, ensure_row_contiguous=False)
_two_pass_1 = SharedKernel("pymlxc_decode_attention_part", ("q", "keys", "values", "pos"),
                           ("partials", "sums", "maxs"), TWO_PASS_1, HEADER, ensure_row_contiguous=False)
_two_pass_2 = SharedKernel("pymlxc_decode_attention_merge", ("partials", "sums", "maxs"), ("out",), TWO_PASS_2,
                           HEADER, ensure_row_contiguous=False)

HEAD_DIMS = (64, 96, 128)  # MLX's one-token kernels' head sizes


def applies(dtype: Any, n_heads: int, n_kv_heads: int, head_dim: int, value_dim: int) -> bool:
    """Whether MLX would attend one query with its own one-token kernels, which these reproduce:
    a floating type, head sizes it has kernels for (values alike), whole query groups."""
    return (dtype in (mx.float16, mx.bfloat16, mx.float32) and head_dim == value_dim and head_dim in HEAD_DIMS
            and n_kv_heads > 0 and n_heads % n_kv_heads == 0)


def one_pass(keys: int) -> bool:
    """Whether attention over `keys` keys runs as the one-pass kernel (MLX's choice)."""
    return keys <= ONE_PASS_KEYS


def _scale_bits(scale: float, single: bool) -> int:
    """The scale times log2 e as each MLX kernel rounds it: the one-pass kernel multiplies the float
    scale by the double M_LOG2E and rounds the product; the two-pass kernel multiplies two floats."""
    s = np.float32(scale)
    if single:
        return float32_bits(float(np.float64(s) * LOG2E))
    return float32_bits(float(s * np.float32(1.44269504089)))


def attend(q: Array, keys: Array, values: Array, pos: Array, scale: float, single: bool, flat: bool = False
           ) -> Array:
    """Attention of `q` [B, HQ, 1, D] over the first `pos[0] + 1` slots of `keys` [B, HKV, slots, D]
    and `values`, as MLX's one-token kernel: `single` the one-pass kernel (up to ONE_PASS_KEYS keys),
    else the two-pass pair. `pos` is int32 holding the position first ([4] in the segments); q is
    row-major; the result [B, HQ, 1, D] has q's type, or with `flat` the same values as [B, 1, HQ * D]
    (the kernels write row-major either way)."""
    b, hq, _, d = q.shape
    shape = (b, 1, hq * d) if flat else (b, hq, 1, d)
    hkv = keys.shape[1]
    template = [("T", q.dtype), ("HQ", hq), ("HKV", hkv), ("D", d), ("SCALE_LOG2_BITS", _scale_bits(scale, single))]
    if single:
        (out,) = _one_pass()([q, keys, values, pos], output_shapes=[shape], output_dtypes=[q.dtype],
                             grid=(hq * 1024, 1, b), threadgroup=(1024, 1, 1), template=template)
        return out
    partials, sums, maxs = _two_pass_1()(
        [q, keys, values, pos], output_shapes=[(b, hq, BLOCKS, d), (b, hq, BLOCKS), (b, hq, BLOCKS)],
        output_dtypes=[mx.float32] * 3, grid=(hq * 256, 1, b * BLOCKS), threadgroup=(256, 1, 1), template=template)
    (out,) = _two_pass_2()([partials, sums, maxs], output_shapes=[shape], output_dtypes=[q.dtype],
                           grid=(hq * 1024, 1, b), threadgroup=(1024, 1, 1), template=template[:4])
    return out


def reference(q: Array, keys: Array, values: Array, pos: Array, scale: float) -> Array:
    """What `attend` computes, as MLX's attention over the keys sliced to `pos[0] + 1` (the position
    read on the host: for checks and the CPU)."""
    p = int(np.asarray(mx.reshape(pos, (-1,)))[0])
    b, hkv, _, d = keys.shape
    dv = values.shape[3]
    return mx.fast.scaled_dot_product_attention(
        q, mx.slice(keys, [0, 0, 0, 0], [b, hkv, p + 1, d], [1, 1, 1, 1]),
        mx.slice(values, [0, 0, 0, 0], [b, hkv, p + 1, dv], [1, 1, 1, 1]), scale=scale)


checks = CheckedOnce("pymlxc's one-token attention CUDA kernels")

# Lengths the check attends over: both kernels, a length under one warp's stride, the one-pass
# kernel's last, the two-pass kernel's first, uneven tails.
CHECK_LENGTHS = (1, 2, 33, 300, 1024, 1025, 1500, 4097)


def check(dtype: Any, n_heads: int, n_kv_heads: int, d: int, scale: float) -> bool:
    """Whether the kernels run here and equal MLX's attention bit for bit at CHECK_LENGTHS keys (once
    per process, shape, type and scale); if not, a RuntimeWarning says why."""
    return checks.verdict((str(dtype), n_heads, n_kv_heads, d, float(np.float32(scale))),
                          lambda: _compare(dtype, n_heads, n_kv_heads, d, scale))


def _compare(dtype: Any, hq: int, hkv: int, d: int, scale: float) -> str | None:
    rng = np.random.default_rng(0)
    slots = 4353  # not a multiple of 256: MLX then keeps its own kernels (cuDNN takes whole 256-slot caches)

    def rand(*shape: int) -> Array:
        return mx.astype(mx.array(rng.standard_normal(shape).astype(np.float32)), dtype)

    keys, values = rand(1, hkv, slots, d), rand(1, hkv, slots, d)
    mx.eval(keys, values)
    for n in CHECK_LENGTHS:
        q = rand(1, hq, 1, d)
        pos = mx.array([n - 1] * 4, dtype=mx.int32)
        got = attend(q, keys, values, pos, scale, one_pass(n))
        want = reference(q, keys, values, pos, scale)
        if not bool(mx.array_equal(got, want).item()):
            return f"its output over {n} keys differs from MLX's attention ({dtype}, head size {d})"
    return None


__all__ = ["ONE_PASS_KEYS", "applies", "attend", "check", "checks", "one_pass", "reference"]
