"""RoPE of a prompt chunk's queries and keys, and the first key and value buffers of a layer's
cache made from it, as one CUDA kernel, for the compiled prefill's first chunk.

Between two segments of the compiled prefill (decode/prefill.py) each layer runs, outside the
trace, MLX's RoPE over the joint q/k heads, then the cache's first update: a fill of zeros and a
slice update for the keys, the same for the values. On a GPU the 128-token prefill of a small model
is bound by the host, which spends about 20 us of MLX's work on each kernel (docs/performance.md,
"Where the 1B's 128-token prefill goes"). Where the cache is still empty (a prompt's first chunk,
the common case), this kernel does those five in one launch: it writes the RoPE'd queries, and
makes the key and value buffers whole (the chunk's rows, then zeros up to the capacity the cache
would have allocated). Its outputs are new arrays: nothing is written in place.

The rotation is `rope_kv.py`'s (MLX's RoPE kernel's arithmetic, `pymlxc_rope`), at positions 0 to
L - 1. `check()` compares it once per shape, type and RoPE with MLX's RoPE and the cache's own
update at several lengths and capacities, on strided inputs as the trace gives them, and keeps
MLX's kernels where any bit differs or it cannot run.
"""
from __future__ import annotations

from typing import Any

import numpy as np

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core.cuda_kernel import SharedKernel, float32_bits

from .check import CheckedOnce
from .rope_kv import HEADER, Rope

THREADS = 256

# Template arguments: T (the heads' and buffers' type), HQ and HKV (query and key/value heads), D
# (head size, all of it rotated), DV (value size), FREQS, SCALE_BITS and LOG2_BASE_BITS as in
# rope_kv.py. `slots` is int32 [4] holding the buffers' capacity first (16 bytes: device memory,
# see rope_kv.py). Inputs are read through their strides (the trace's heads are views of one
# projection). Threads: one per rotated pair of every query and key head and row, then one per
# value buffer element, then one per key buffer element past the chunk's rows (zeros).
SOURCE = r"""
  constexpr int HALF = D / 2;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t B = q_in_shape[0];
  const int64_t L = q_in_shape[2];
  const int64_t C = slots[0];
  const int64_t pairs = B * (HQ + HKV) * L * HALF;
  const int64_t vitems = B * HKV * C * DV;
  const int64_t kzeros = B * HKV * (C - L) * D;
  if (t < pairs) {
    const int i = t % HALF;
    const int64_t r = (t / HALF) % L;
    const int head = (t / (HALF * L)) % (HQ + HKV);
    const int64_t b = t / (HALF * L * (HQ + HKV));
    float costheta, sintheta;
    pymlxc_rope::angle<FREQS>(rope, i, HALF, static_cast<int>(r), __int_as_float(SCALE_BITS),
                              __int_as_float(LOG2_BASE_BITS), costheta, sintheta);
    const T* x;
    int64_t step;
    if (head < HQ) {
      x = q_in + b * q_in_strides[0] + head * q_in_strides[1] + r * q_in_strides[2];
      step = q_in_strides[3];
    } else {
      x = k_in + b * k_in_strides[0] + (head - HQ) * k_in_strides[1] + r * k_in_strides[2];
      step = k_in_strides[3];
    }
    float x1 = static_cast<float>(x[i * step]);
    float x2 = static_cast<float>(x[(i + HALF) * step]);
    float rx1, rx2;
    pymlxc_rope::rotate(x1, x2, costheta, sintheta, rx1, rx2);
    T* y = head < HQ ? q + ((b * HQ + head) * L + r) * D : keys + ((b * HKV + (head - HQ)) * C + r) * D;
    y[i] = static_cast<T>(rx1);
    y[i + HALF] = static_cast<T>(rx2);
  } else if (t < pairs + vitems) {
    const int64_t u = t - pairs;
    const int j = u % DV;
    const int64_t s = (u / DV) % C;
    const int h = (u / (DV * C)) % HKV;
    const int64_t b = u / (DV * C * HKV);
    values[u] = s < L ? v_in[b * v_in_strides[0] + h * v_in_strides[1] + s * v_in_strides[2] + j * v_in_strides[3]]
                      : static_cast<T>(0);
  } else if (t < pairs + vitems + kzeros) {
    const int64_t w = t - pairs - vitems;
    const int j = w % D;
    const int64_t s = L + (w / D) % (C - L);
    const int64_t bh = w / (D * (C - L));
    keys[(bh * C + s) * D + j] = static_cast<T>(0);
  }
"""

_the_kernel = SharedKernel("pymlxc_rope_fill_kv", ("q_in", "k_in", "v_in", "slots", "rope"),
                           ("q", "keys", "values"), SOURCE, header=HEADER, ensure_row_contiguous=False)


def slots_array(capacity: int) -> Array:
    """The capacity as the kernel reads it (int32 [4], the capacity first)."""
    return mx.array([capacity, 0, 0, 0], dtype=mx.int32)


def rope_fill_kv(q: Array, k: Array, v: Array, slots: Array, capacity: int, rope: Rope
                 ) -> tuple[Array, Array, Array]:
    """(queries RoPE'd at positions 0..L-1 [B, HQ, L, D], keys [B, HKV, capacity, D], values [B, HKV,
    capacity, DV]) from a prompt's first chunk q [B, HQ, L, D], k [B, HKV, L, D] (before RoPE) and
    v [B, HKV, L, DV], any strides, one type: the buffers hold the RoPE'd keys and the values in
    slots 0..L-1 and zeros after. `slots` is `slots_array(capacity)`; capacity >= L."""
    b, hq, length, d = q.shape
    hkv, dv = k.shape[1], v.shape[3]
    if capacity < length:
        raise ValueError(f"a cache of {capacity} slots cannot take a chunk of {length} tokens")
    items = b * (hq + hkv) * length * (d // 2) + b * hkv * capacity * dv + b * hkv * (capacity - length) * d
    outs = _the_kernel()([q, k, v, slots, rope.table],
                         output_shapes=[(b, hq, length, d), (b, hkv, capacity, d), (b, hkv, capacity, dv)],
                         output_dtypes=[q.dtype] * 3,
                         grid=(items, 1, 1), threadgroup=(THREADS, 1, 1),
                         template=[("T", q.dtype), ("HQ", hq), ("HKV", hkv), ("D", d), ("DV", dv),
                                   ("FREQS", rope.with_freqs),
                                   ("SCALE_BITS", float32_bits(rope.scale_value)),
                                   ("LOG2_BASE_BITS", 0 if rope.with_freqs else float32_bits(rope.log2_base))])
    return outs[0], outs[1], outs[2]


def reference(q: Array, k: Array, v: Array, capacity: int, apply_rope: Any) -> tuple[Array, Array, Array]:
    """What `rope_fill_kv` computes, as MLX's kernels: the model's RoPE (`apply_rope(x, offset)`)
    of q and k at offset 0, and buffers of zeros with the chunk written in (the cache's own first
    update, cache.KVCache)."""
    b, hkv, length, d = k.shape
    dv = v.shape[3]
    keys = mx.slice_update(mx.zeros((b, hkv, capacity, d), k.dtype), apply_rope(k, 0),
                           [0, 0, 0, 0], [b, hkv, length, d], [1, 1, 1, 1])
    values = mx.slice_update(mx.zeros((b, hkv, capacity, dv), v.dtype), v,
                             [0, 0, 0, 0], [b, hkv, length, dv], [1, 1, 1, 1])
    return apply_rope(q, 0), keys, values


checks = CheckedOnce("pymlxc's RoPE + first cache buffers CUDA kernel")


def check(dtype: Any, n_heads: int, n_kv_heads: int, d: int, dv: int, rope: Rope, apply_rope: Any) -> bool:
    """Whether the kernel runs here and equals MLX's RoPE (`apply_rope(x, offset)`, the model's
    module) and the cache's first update bit for bit (once per machine, shape, type and RoPE); if
    not, a RuntimeWarning says why."""
    return checks.verdict((str(dtype), n_heads, n_kv_heads, d, dv, rope.key),
                          lambda: _compare(dtype, n_heads, n_kv_heads, d, dv, rope, apply_rope))


def _compare(dtype: Any, hq: int, hkv: int, d: int, dv: int, rope: Rope, apply_rope: Any) -> str | None:
    rng = np.random.default_rng(0)
    for batch, length, capacity in ((1, 1, 264), (1, 128, 264), (2, 77, 77), (1, 1000, 1288)):
        # The heads as the compiled prefill hands them over: views of one [B, L, heads * D] product,
        # transposed to [B, heads, L, D] (so neither row-major nor alike in their strides).
        joint = mx.astype(mx.array(rng.standard_normal((batch, length, (hq + 2 * hkv) * d)).astype(np.float32)),
                          dtype)
        heads = mx.transpose(mx.reshape(joint, (batch, length, hq + 2 * hkv, d)), (0, 2, 1, 3))
        q = mx.slice(heads, [0, 0, 0, 0], [batch, hq, length, d], [1, 1, 1, 1])
        k = mx.slice(heads, [0, hq, 0, 0], [batch, hq + hkv, length, d], [1, 1, 1, 1])
        v_full = mx.astype(mx.array(rng.standard_normal((batch, length, hkv, dv)).astype(np.float32)), dtype)
        v = mx.transpose(v_full, (0, 2, 1, 3))
        got = rope_fill_kv(q, k, v, slots_array(capacity), capacity, rope)
        want = reference(q, k, v, capacity, apply_rope)
        mx.eval(*got, *want)
        same = [bool(mx.array_equal(a, e).item()) and a.shape == e.shape for a, e in zip(got, want, strict=True)]
        if not all(same):
            what = ", ".join(n for n, s in zip(("queries", "keys", "values"), same, strict=True) if not s)
            return (f"its {what} for {batch} x {length} tokens into {capacity} slots differ from MLX's RoPE and "
                    f"the cache's update ({dtype}, head size {d})")
    return None


__all__ = ["SOURCE", "check", "reference", "rope_fill_kv", "slots_array"]
