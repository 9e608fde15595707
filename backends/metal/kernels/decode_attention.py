"""One token's attention over the first `pos + 1` keys of a decode buffer, the position read on the
device, as CUDA kernels: what lets a whole decode step be one compiled graph.

MLX's attention takes keys of an exact length, so the decode segments slice each layer's buffer to
`pos + 1` keys outside the compiled graph, and a step is 17 compiled calls and 48 operations built
from Python for Llama-3.2-1B. On an H100 that build took about 0.9-1.1 ms a token against
1.1-1.3 ms for MLX to encode the step, and the evaluation thread lost a fifth of its time waiting
for the interpreter lock the building thread held (`benchmarks/profile/probe_host_split.py`). These
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

from . import rope_kv
from .check import CheckedOnce
from .rope_kv import Rope

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
def _key_step(key: str, value: str) -> str:
    """One key's step of the online softmax: the warp's score (element j of the key read as `key`,
    of the value as `value`), MLX's update in exp2, the output accumulated."""
    return r"""
#pragma unroll
    for (int j = 0; j < VPT; j++) kv[j] = """ + key + r""";
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
    for (int j = 0; j < VPT; j++) o[j] = o[j] * factor + exp_score * static_cast<float>(""" + value + r""");
"""


# Both kernels' step over a key of the buffer, then the pointers move (with the loop's closing brace).
_KEY_LOOP = _key_step("K[VPT * lane + j]", "V[VPT * lane + j]") + r"""    K += k_step;
    V += v_step;
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
#pragma unroll
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
#pragma unroll
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

# The RoPE kernel's work inside the attention (`rope_attend`): each block rotates its query head and
# its key/value head's key at the position with `kernels/rope_kv.py`'s arithmetic (lane l holds
# elements VPT * l .. VPT * l + VPT - 1, its rotation partner is lane l ^ 16), attends over the
# buffer's keys before the position and then over the rotated key in registers (in the place of the
# warp that would read it), and the first block of each key/value head writes the key and the value
# into the buffers. Extra template arguments: FREQS, SCALE_BITS, LOG2_BASE_BITS (as the RoPE kernel's)
# and WRITER (the condition under which a warp writes, besides being its head group's first).
_ROPE_Q = r"""
  const int p = kL - 1;
  constexpr int HALF = D / 2;
  float qv[VPT], kv[VPT], o[VPT], vp[VPT];
  T kp[VPT];
  const float L = __int_as_float(SCALE_BITS) * static_cast<float>(p);
#pragma unroll
  for (int i = 0; i < VPT; i++) {
    const int e = VPT * lane + i;
    const int ip = e % HALF;
    float inv_freq;
    if (FREQS) {
      inv_freq = 1.0 / rope[ip];
    } else {
      float d = static_cast<float>(ip) / static_cast<float>(HALF);
      inv_freq = exp2(-d * __int_as_float(LOG2_BASE_BITS));
    }
    float theta = L * inv_freq;
    float costheta = cos(theta);
    float sintheta = sin(theta);
    const T* x = qk + b * qk_strides[0] + e * qk_strides[3];
    float xq = static_cast<float>(x[head * qk_strides[1]]);
    float xk = static_cast<float>(x[(HQ + kvh) * qk_strides[1]]);
    float yq = __shfl_xor_sync(0xffffffffu, xq, 16);
    float yk = __shfl_xor_sync(0xffffffffu, xk, 16);
    float rq, rk;
    if (e < HALF) {
      float x1 = xq, x2 = yq;
      rq = x1 * costheta - x2 * sintheta;
      x1 = xk; x2 = yk;
      rk = x1 * costheta - x2 * sintheta;
    } else {
      float x1 = yq, x2 = xq;
      rq = x1 * sintheta + x2 * costheta;
      x1 = yk; x2 = xk;
      rk = x1 * sintheta + x2 * costheta;
    }
    qv[i] = scale_log2 * static_cast<float>(static_cast<T>(rq));
    kp[i] = static_cast<T>(rk);
    vp[i] = static_cast<float>(v[b * v_strides[0] + kvh * v_strides[1] + e * v_strides[3]]);
    o[i] = 0.f;
  }
  if (WRITER && head % (HQ / HKV) == 0 && w == 0) {
    T* kw = const_cast<T*>(keys) + b * keys_strides[0] + kvh * keys_strides[1] + static_cast<int64_t>(p) * keys_strides[2];
    T* vw = const_cast<T*>(values) + b * values_strides[0] + kvh * values_strides[1] + static_cast<int64_t>(p) * values_strides[2];
#pragma unroll
    for (int i = 0; i < VPT; i++) {
      kw[(VPT * lane + i) * keys_strides[3]] = kp[i];
      vw[(VPT * lane + i) * values_strides[3]] = v[b * v_strides[0] + kvh * v_strides[1] + (VPT * lane + i) * v_strides[3]];
    }
  }
  float max_score = Limits<float>::finite_min();
  float sum_exp_score = 0.f;
"""


def _with_rope(source: str, loop: str, owner: str, writer: str) -> str:
    """`source` (a kernel above) with the RoPE kernel's work inside: no query input, the loop over
    the buffer's keys stopping before the position, the position's key from registers in the warp
    `owner` names, the writes where `writer` holds."""
    q_line = "  const T* Q = q + (static_cast<int64_t>(b) * HQ + head) * D;\n"
    header = f"  for (int i = {loop}; i < kL; "
    assert q_line in source and _SCALED_Q in source and header in source and _KEY_LOOP in source
    source = source.replace(q_line, "").replace(_SCALED_Q, _ROPE_Q.replace("WRITER", writer))
    source = source.replace(header, f"  for (int i = {loop}; i < p; ")
    key_p = "  if (" + owner + ") {\n" + _key_step("static_cast<float>(kp[j])", "vp[j]") + "  }\n"
    return source.replace(_KEY_LOOP, _KEY_LOOP + key_p)


ROPE_ONE_PASS = _with_rope(ONE_PASS, "w", "p % BN == w", "true")
ROPE_TWO_PASS_1 = _with_rope(TWO_PASS_1, "first", "p % (NB * BN) == first", "part == 0")

_one_pass = SharedKernel("pymlxc_decode_attention", ("q", "keys", "values", "pos"), ("out",), ONE_PASS,
                         HEADER, ensure_row_contiguous=False)
_two_pass_1 = SharedKernel("pymlxc_decode_attention_part", ("q", "keys", "values", "pos"),
                           ("partials", "sums", "maxs"), TWO_PASS_1, HEADER, ensure_row_contiguous=False)
_two_pass_2 = SharedKernel("pymlxc_decode_attention_merge", ("partials", "sums", "maxs"), ("out",), TWO_PASS_2,
                           HEADER, ensure_row_contiguous=False)

_rope_one_pass = SharedKernel("pymlxc_rope_attention", ("qk", "v", "keys", "values", "pos", "rope"), ("out",),
                              ROPE_ONE_PASS, HEADER, ensure_row_contiguous=False)
_rope_two_pass_1 = SharedKernel("pymlxc_rope_attention_part", ("qk", "v", "keys", "values", "pos", "rope"),
                                ("partials", "sums", "maxs"), ROPE_TWO_PASS_1, HEADER, ensure_row_contiguous=False)

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


def attend(q: Array, keys: Array, values: Array, pos: Array, scale: float, single: bool) -> Array:
    """Attention of `q` [B, HQ, 1, D] over the first `pos[0] + 1` slots of `keys` [B, HKV, slots, D]
    and `values`, as MLX's one-token kernel: `single` the one-pass kernel (up to ONE_PASS_KEYS keys),
    else the two-pass pair. `pos` is int32 holding the position first ([4] in the segments); q is
    row-major; the result [B, HQ, 1, D] has q's type."""
    b, hq, _, d = q.shape
    hkv = keys.shape[1]
    template = [("T", q.dtype), ("HQ", hq), ("HKV", hkv), ("D", d), ("SCALE_LOG2_BITS", _scale_bits(scale, single))]
    if single:
        (out,) = _one_pass()([q, keys, values, pos], output_shapes=[(b, hq, 1, d)], output_dtypes=[q.dtype],
                             grid=(hq * 1024, 1, b), threadgroup=(1024, 1, 1), template=template)
        return out
    partials, sums, maxs = _two_pass_1()(
        [q, keys, values, pos], output_shapes=[(b, hq, BLOCKS, d), (b, hq, BLOCKS), (b, hq, BLOCKS)],
        output_dtypes=[mx.float32] * 3, grid=(hq * 256, 1, b * BLOCKS), threadgroup=(256, 1, 1), template=template)
    (out,) = _two_pass_2()([partials, sums, maxs], output_shapes=[(b, hq, 1, d)], output_dtypes=[q.dtype],
                           grid=(hq * 1024, 1, b), threadgroup=(1024, 1, 1), template=template[:4])
    return out


def rope_attend(qk: Array, v: Array, keys: Array, values: Array, pos: Array, rope: Rope, n_heads: int, scale: float,
                single: bool) -> tuple[Array, Array, Array]:
    """`kernels/rope_kv.py`'s `rope_write_kv` and `attend` as one kernel (two passes: two kernels):
    `qk` the joint q and k heads before RoPE [B, n_heads + kv heads, 1, D], `v` [B, kv heads, 1, D];
    the rotated key and the value go into `keys` and `values` at slot `pos[0]` in place. Returns
    (the attention of the rotated queries over the first `pos[0] + 1` slots [B, n_heads, 1, D], keys,
    values): the same buffers, as `rope_write_kv` returns them."""
    b, heads, _, d = qk.shape
    hkv = heads - n_heads
    template = [("T", qk.dtype), ("HQ", n_heads), ("HKV", hkv), ("D", d),
                ("SCALE_LOG2_BITS", _scale_bits(scale, single)), ("FREQS", rope.with_freqs),
                ("SCALE_BITS", float32_bits(rope.scale_value)),
                ("LOG2_BASE_BITS", 0 if rope.with_freqs else float32_bits(rope.log2_base))]
    inputs = [qk, v, keys, values, pos, rope.table]
    if single:
        (out,) = _rope_one_pass()(inputs, output_shapes=[(b, n_heads, 1, d)], output_dtypes=[qk.dtype],
                                  grid=(n_heads * 1024, 1, b), threadgroup=(1024, 1, 1), template=template)
        return out, keys, values
    partials, sums, maxs = _rope_two_pass_1()(
        inputs, output_shapes=[(b, n_heads, BLOCKS, d), (b, n_heads, BLOCKS), (b, n_heads, BLOCKS)],
        output_dtypes=[mx.float32] * 3, grid=(n_heads * 256, 1, b * BLOCKS), threadgroup=(256, 1, 1),
        template=template)
    (out,) = _two_pass_2()([partials, sums, maxs], output_shapes=[(b, n_heads, 1, d)], output_dtypes=[qk.dtype],
                           grid=(n_heads * 1024, 1, b), threadgroup=(1024, 1, 1), template=template[:4])
    return out, keys, values


def rope_reference(qk: Array, v: Array, pos: Array, keys: Array, values: Array, rope: Any, n_heads: int,
                   scale: float) -> tuple[Array, Array, Array]:
    """What `rope_attend` computes, as MLX's kernels (`rope(x, offset)`: the model's RoPE module;
    arguments in `rope_kv.reference`'s order): (attention output, keys, values), the buffers as new
    arrays."""
    q, k, v2 = rope_kv.reference(qk, v, pos, keys, values, rope, n_heads)
    return reference(q, k, v2, pos, scale), k, v2


rope_checks = CheckedOnce("pymlxc's RoPE + one-token attention CUDA kernels")


def rope_check(dtype: Any, n_heads: int, n_kv_heads: int, d: int, scale: float, spec: Rope, module: Any) -> bool:
    """Whether `rope_attend` runs here and equals MLX's RoPE, slice updates and attention bit for bit
    (output and buffers) at CHECK_LENGTHS keys, once per process, shape, type, scale and RoPE."""
    return rope_checks.verdict((str(dtype), n_heads, n_kv_heads, d, float(np.float32(scale)), spec.key),
                               lambda: _compare_rope(dtype, n_heads, n_kv_heads, d, scale, spec, module))


def _compare_rope(dtype: Any, hq: int, hkv: int, d: int, scale: float, spec: Rope, module: Any) -> str | None:
    rng = np.random.default_rng(1)
    slots = 4353

    def rand(*shape: int) -> Array:
        return mx.astype(mx.array(rng.standard_normal(shape).astype(np.float32)), dtype)

    keys, values = rand(1, hkv, slots, d), rand(1, hkv, slots, d)
    want_k, want_v = keys, values
    keys, values = rope_kv.private_copy(keys), rope_kv.private_copy(values)
    mx.eval(keys, values, want_k, want_v)
    for n in CHECK_LENGTHS:
        qk, v = rand(1, hq + hkv, 1, d), rand(1, hkv, 1, d)
        pos = mx.array([n - 1] * 4, dtype=mx.int32)
        got, keys, values = rope_attend(qk, v, keys, values, pos, spec, hq, scale, one_pass(n))
        mx.eval(got)
        want, want_k, want_v = rope_reference(qk, v, pos, want_k, want_v, module, hq, scale)
        same = [bool(mx.array_equal(a, e).item()) for a, e in ((got, want), (keys, want_k), (values, want_v))]
        if not all(same):
            what = ", ".join(name for name, ok in zip(("output", "keys", "values"), same, strict=True) if not ok)
            return f"its {what} over {n} keys differ from MLX's RoPE, slice updates and attention ({dtype}, head size {d})"
    return None


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


__all__ = ["ONE_PASS_KEYS", "applies", "attend", "check", "checks", "one_pass", "reference", "rope_attend",
           "rope_check", "rope_checks", "rope_reference"]
