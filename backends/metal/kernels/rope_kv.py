"""RoPE of one token's queries and keys, and its key and value written into the decode buffers, as
one CUDA kernel, for the decode segments.

In a segmented Llama-family decode step each layer's attention takes three small kernels before
MLX's attention kernel: RoPE over the joint q/k heads, then a slice update for the key and one for
the value. On an H100 a Llama-3.2-1B bf16 step is bound by the device, and such kernels (a few
kilobytes each) cost 2.8-4.8 us apiece timed alone, mostly launch and tail (docs/performance.md,
"Where a step's device time goes"). This kernel does the three in one launch: 32 kernels fewer per step there.

It writes the key and the value into the buffers in place. MLX's custom kernels have no in-place
outputs, so the buffers go in as inputs, and the kernel writes through them; what orders it:
  * the roped queries are its output, and MLX's attention takes them, so the attention that reads
    the buffers runs after the writes (MLX orders a CUDA graph's kernels by their arrays);
  * the next write into a layer's buffers needs the next token, which needs this step's attention
    of every layer;
  * the decode session owns the buffers alone: it copies them once at its start (`private_copy`),
    so no other array (a prompt-cache snapshot, a view of a longer buffer) sees the writes;
  * those copies are row-major: over a permuted buffer (heads inside slots, as `take` gives) MLX's
    attention after the writes was wrong on the H100, though the written values were exact.
Shapes and strides are read from MLX's arguments (no copy of a strided input, which would lose the
writes).

The rotation reproduces MLX's RoPE kernel (`rope_single`, `rope_single_freqs`) arithmetic for
arithmetic: the inverse frequency as `exp2(-d * log2(base))` or `1.0 / freqs[i]` (in double, as
MLX writes it), `theta = (scale * position) * inv_freq`, float `cos` and `sin`, the same two
products per output. `check()` runs it once per shape, type and RoPE against MLX's RoPE and slice
updates at several positions, and keeps MLX's kernels where any bit differs or it cannot run.

This module holds the source and the launch; `segments.py` decides where to use it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core.cuda_kernel import SharedKernel, float32_bits

from .check import CheckedOnce

THREADS = 128

# The rotation's arithmetic, MLX's RoPE kernel's (mlx/backend/cuda/rope.cu), as device functions:
# this kernel and the matvec kernel's RoPE form (`matvec.py`) both call them.
HEADER = r"""
namespace pymlxc_rope {

// cos and sin of the angle by which pair i of `half` turns at position p: 1 / rope[i] as the
// frequency where FREQS (a table), else base ** (-i / half) from log2(base).
template <bool FREQS>
__device__ __forceinline__ void angle(const float* rope, int i, int half, int p, float scale, float log2_base,
                                      float& costheta, float& sintheta) {
  float inv_freq;
  if (FREQS) {
    inv_freq = 1.0 / rope[i];
  } else {
    float d = static_cast<float>(i) / static_cast<float>(half);
    inv_freq = exp2(-d * log2_base);
  }
  float L = scale * static_cast<float>(p);
  float theta = L * inv_freq;
  costheta = cos(theta);
  sintheta = sin(theta);
}

__device__ __forceinline__ void rotate(float x1, float x2, float costheta, float sintheta, float& rx1, float& rx2) {
  rx1 = x1 * costheta - x2 * sintheta;
  rx2 = x1 * sintheta + x2 * costheta;
}

}  // namespace pymlxc_rope
"""

# Template arguments: T (the type of the heads and buffers), HQ and HKV (query and key/value
# heads), D (head size, all of it rotated), DV (value size), JOINT (`qk` is the fused q/k/v
# projection's output as it comes, [B, 1, (HQ + 2 HKV) * D], and `v` is unread: the step's graph
# then holds no reshape or slices between the projection and this kernel, nodes that MLX builds
# and encodes each token like kernels), FREQS (a frequency per pair in `rope`,
# else LOG2_BASE_BITS is log2 of the base), SCALE_BITS and LOG2_BASE_BITS (float32 bits). One thread
# per rotated pair of every q and k head, then one per value element. The scale and the base are
# compile-time constants rather than one-value inputs: MLX's CUDA allocator keeps arrays of 8 bytes
# or less in managed memory, which a kernel reads at about PCIe latency (microseconds). The kernel
# reads the position as pos[0], so the decode passes an int32 [4] (16 bytes: device memory).
SOURCE = r"""
  constexpr int HALF = D / 2;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t rows = qk_shape[0];
  const int64_t pairs = rows * (HQ + HKV) * HALF;
  const int p = pos[0];
  if (t < pairs) {
    const int i = t % HALF;
    const int head = (t / HALF) % (HQ + HKV);
    const int64_t b = t / (HALF * (HQ + HKV));
    float costheta, sintheta;
    pymlxc_rope::angle<FREQS>(rope, i, HALF, p, __int_as_float(SCALE_BITS), __int_as_float(LOG2_BASE_BITS),
                              costheta, sintheta);
    // JOINT: `qk` is the q/k/v projection's whole output [B, 1, (HQ + 2 HKV) * D], heads in order.
    const T* x = JOINT ? qk + b * qk_strides[0] + static_cast<int64_t>(head) * D * qk_strides[2]
                       : qk + b * qk_strides[0] + head * qk_strides[1];
    const int64_t step = JOINT ? qk_strides[2] : qk_strides[3];
    float x1 = static_cast<float>(x[i * step]);
    float x2 = static_cast<float>(x[(i + HALF) * step]);
    float rx1, rx2;
    pymlxc_rope::rotate(x1, x2, costheta, sintheta, rx1, rx2);
    if (head < HQ) {
      T* y = q + (b * HQ + head) * D;
      y[i] = static_cast<T>(rx1);
      y[i + HALF] = static_cast<T>(rx2);
    } else {
      T* y = const_cast<T*>(kcache) + b * kcache_strides[0] + (head - HQ) * kcache_strides[1]
          + static_cast<int64_t>(p) * kcache_strides[2];
      y[i * kcache_strides[3]] = static_cast<T>(rx1);
      y[(i + HALF) * kcache_strides[3]] = static_cast<T>(rx2);
    }
  } else if (t < pairs + rows * HKV * DV) {
    const int64_t u = t - pairs;
    const int j = u % DV;
    const int h = (u / DV) % HKV;
    const int64_t b = u / (DV * HKV);
    T* y = const_cast<T*>(vcache) + b * vcache_strides[0] + h * vcache_strides[1]
        + static_cast<int64_t>(p) * vcache_strides[2];
    y[j * vcache_strides[3]] = JOINT
        ? qk[b * qk_strides[0] + (static_cast<int64_t>(HQ + HKV) * D + h * DV + j) * qk_strides[2]]
        : v[b * v_strides[0] + h * v_strides[1] + j * v_strides[3]];
  }
"""

_the_kernel = SharedKernel("pymlxc_rope_write_kv", ("qk", "v", "pos", "rope", "kcache", "vcache"),
                           ("q",), SOURCE, header=HEADER, ensure_row_contiguous=False)


@dataclass(frozen=True)
class Rope:
    """A RoPE as the kernel takes it: `table` is the frequencies (float32 [D/2]; a placeholder the
    kernel does not read where the base gives them), `log2_base` log2 of the base as float32 (0 with
    frequencies); `key` tells RoPEs apart for `check`; `base` and `scale_value` as the module has
    them."""

    table: Array
    with_freqs: bool
    key: tuple[Any, ...]
    base: float | None
    scale_value: float
    log2_base: float = 0.0

    def mlx(self, x: Array, offset: Array) -> Array:
        """The same RoPE as MLX's kernel computes it (over the whole last axis of `x`)."""
        return mx.fast.rope(x, x.shape[-1], traditional=False, base=self.base, scale=self.scale_value,
                            offset=offset, freqs=self.table if self.with_freqs else None)


@functools.cache
def _log2f(x: float) -> float:
    """log2 of a float32 as MLX's host code computes it (std::log2 of a float: the C library's
    log2f), for the kernel's base; Python's own where that library is not found."""
    name = ctypes.util.find_library("m")
    if name:
        try:
            fn = ctypes.CDLL(name).log2f
            fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
            return float(fn(ctypes.c_float(x)))
        except (OSError, AttributeError):
            pass
    return float(np.float32(math.log2(float(np.float32(x)))))


def rope_table(*, dims: int, traditional: bool, base: float | None, scale: float, freqs: Array | None,
               head_dim: int) -> Rope | None:
    """The kernel's form of a RoPE (models.base.RoPE's fields) rotating all `head_dim` features in
    the usual (non-traditional) layout; None for anything else (then MLX's kernels stay)."""
    if traditional or dims != head_dim or head_dim % 2:
        return None
    if freqs is not None:
        if tuple(freqs.shape) != (head_dim // 2,):
            return None
        table = mx.astype(freqs, mx.float32)
        mx.eval(table)
        return Rope(table, True, ("freqs", np.asarray(table).tobytes(), scale), None, scale)
    if base is None:
        return None
    log_base = _log2f(base)
    placeholder = mx.zeros((head_dim // 2,), dtype=mx.float32)
    mx.eval(placeholder)
    return Rope(placeholder, False, ("base", log_base, scale), base, scale, log_base)


def scalar_position(pos: Array) -> Array:
    """The position as MLX's ops take it: a scalar view of the first element of `pos` (a scalar or
    int32 [N] whose elements are the position)."""
    return mx.reshape(mx.slice(mx.reshape(pos, (-1,)), [0], [1], [1]), ())


def rope_write_kv(qk: Array, v: Array | None, pos: Array, keys: Array, values: Array, rope: Rope, n_heads: int
                  ) -> tuple[Array, Array, Array]:
    """(queries of one token RoPE'd at `pos` [B, n_heads, 1, D], keys, values): its key (RoPE'd)
    and value go into `keys` [B, kv heads, slots, D] and `values` at slot `pos`, in place (the
    same arrays come back). `qk` is the joint q and k heads [B, n_heads + kv heads, 1, D], `v`
    [B, kv heads, 1, DV]; or, with `v` None, `qk` is the fused projection's output [B, 1,
    (n_heads + 2 kv heads) * D] (values of the keys' size). `pos` int32 holding the position first
    (a scalar or [N]); heads and buffers of one type."""
    joint = v is None
    hkv, d, dv = keys.shape[1], keys.shape[3], values.shape[3]
    b, heads = qk.shape[0], n_heads + hkv
    items = b * heads * (d // 2) + b * hkv * dv
    (q,) = _the_kernel()([qk, qk if v is None else v, pos, rope.table, keys, values],
                         output_shapes=[(b, n_heads, 1, d)], output_dtypes=[qk.dtype],
                         grid=(items, 1, 1), threadgroup=(THREADS, 1, 1),
                         template=[("T", qk.dtype), ("HQ", n_heads), ("HKV", hkv), ("D", d), ("DV", dv),
                                   ("JOINT", joint), ("FREQS", rope.with_freqs),
                                   ("SCALE_BITS", float32_bits(rope.scale_value)),
                                   ("LOG2_BASE_BITS", 0 if rope.with_freqs else float32_bits(rope.log2_base))])
    return q, keys, values


def split_joint(qkv: Array, n_heads: int, n_kv_heads: int, d: int) -> tuple[Array, Array]:
    """The fused projection's output [B, 1, (n_heads + 2 n_kv_heads) * d] as (joint q and k heads
    [B, n_heads + n_kv_heads, 1, d], v [B, n_kv_heads, 1, d]): a reshape and two slices, views, as
    the segments take them apart where the kernel does not read the output as it is."""
    b, heads = qkv.shape[0], n_heads + n_kv_heads
    all_heads = mx.reshape(qkv, (b, heads + n_kv_heads, 1, d))
    return (mx.slice(all_heads, [0, 0, 0, 0], [b, heads, 1, d], [1, 1, 1, 1]),
            mx.slice(all_heads, [0, heads, 0, 0], [b, heads + n_kv_heads, 1, d], [1, 1, 1, 1]))


def reference(qk: Array, v: Array | None, pos: Array, keys: Array, values: Array, apply_rope: Any, n_heads: int
              ) -> tuple[Array, Array, Array]:
    """What `rope_write_kv` computes, as MLX's kernels (`apply_rope(x, offset)`: the model's RoPE
    module), with new key and value arrays instead of writes in place."""
    if v is None:
        qk, v = split_joint(qk, n_heads, keys.shape[1], keys.shape[3])
    b, heads, _, d = qk.shape
    pos = scalar_position(pos)
    roped = apply_rope(qk, pos)
    q = mx.slice(roped, [0, 0, 0, 0], [b, n_heads, 1, d], [1, 1, 1, 1])
    k = mx.slice(roped, [0, n_heads, 0, 0], [b, heads, 1, d], [1, 1, 1, 1])
    start = mx.reshape(pos, (1,))  # along the slots' axis; no read of the position on the host
    return q, _slice_update_at(keys, k, start), _slice_update_at(values, v, start)


def _slice_update_at(buffer: Array, update: Array, start: Array) -> Array:
    return mx.slice_update_dynamic(buffer, update, start, [2])


def private_copy(a: Array) -> Array:
    """`a`'s values in a row-major buffer no other array shares (MLX reuses `a`'s own where nothing
    else holds it): what the kernel may write into in place. Row-major on purpose: a multiply keeps
    a permuted input's layout (a ring gathered with `take` has its heads inside its slots), and on
    the H100 such buffers gave wrong tokens after a prompt-cache restore (found by the prompt-cache
    tests), while row-major ones never did."""
    return mx.multiply(mx.contiguous(a, False), mx.array(1, dtype=a.dtype))


checks = CheckedOnce("pymlxc's RoPE + cache-write CUDA kernel")


def check(dtype: Any, n_heads: int, n_kv_heads: int, d: int, dv: int, rope: Rope, apply_rope: Any) -> bool:
    """Whether the kernel runs here and equals MLX's RoPE (`apply_rope(x, offset)`, the model's
    module) and slice updates bit for bit, at positions from 0 to 8191 (once per process, shape, type
    and RoPE); if not, a RuntimeWarning says why."""
    return checks.verdict((str(dtype), n_heads, n_kv_heads, d, dv, rope.key),
                          lambda: _compare(dtype, n_heads, n_kv_heads, d, dv, rope, apply_rope))


def _compare(dtype: Any, hq: int, hkv: int, d: int, dv: int, rope: Rope, apply_rope: Any) -> str | None:
    rng = np.random.default_rng(0)
    slots = 8192

    def rand(*shape: int) -> Array:
        return mx.astype(mx.array(rng.standard_normal(shape).astype(np.float32)), dtype)

    keys, values = rand(1, hkv, slots, d), rand(1, hkv, slots, dv)
    want_k, want_v = keys, values
    keys, values = private_copy(keys), private_copy(values)
    mx.eval(keys, values, want_k, want_v)
    # Each position in both forms: the heads apart, and (values of the keys' size) the fused
    # projection's output as it comes.
    forms = (False, True) if dv == d else (False,)
    for p, joint in ((p, joint) for p in (0, 1, 77, 1000, 4097, slots - 1) for joint in forms):
        if joint:
            qk, v = rand(1, 1, (hq + 2 * hkv) * d), None
        else:
            qk, v = rand(1, hq + hkv, 1, d), rand(1, hkv, 1, dv)
        pos = mx.array([p] * 4, dtype=mx.int32)  # as the decode segments carry it
        q, keys, values = rope_write_kv(qk, v, pos, keys, values, rope, hq)
        mx.eval(q)
        want_q, want_k, want_v = reference(qk, v, pos, want_k, want_v, apply_rope, hq)
        same = [bool(mx.array_equal(a, e).item()) for a, e in ((q, want_q), (keys, want_k), (values, want_v))]
        if not all(same):
            what = ", ".join(n for n, s in zip(("queries", "keys", "values"), same, strict=True) if not s)
            form = "the fused projection's output" if joint else "separate heads"
            return (f"its {what} at position {p} from {form} differ from MLX's RoPE and slice updates "
                    f"({dtype}, head size {d})")
    return None


__all__ = ["Rope", "check", "checks", "private_copy", "reference", "rope_table", "rope_write_kv", "scalar_position",
           "split_joint"]
