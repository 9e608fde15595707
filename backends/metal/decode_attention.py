"""One-token attention over a fixed-size key/value buffer whose first `pos + 1` slots are filled.

This is what lets a whole decode step be one compiled graph with a fused attention: the buffer's
shape never changes, and the number of keys to read is an input array (`pos`), not a shape.
MLX's own fused attention needs exact-length keys (a slice whose length changes every token, so
it cannot sit inside one trace); MLX's CUDA decode kernels take no mask either, so a masked
attention over the buffer runs unfused (scale, matmul, mask, softmax, matmul per layer).

On MLX's CUDA build `attend` runs a custom kernel pair (split-K "flash decoding"):

* `partial`: one block per (batch row and query head, chunk of CHUNK slots). The block scores its
  chunk's filled slots, takes their softmax over the chunk and sums the values weighted by it;
  both passes read whole key/value rows with 16-byte loads (D / 8 threads per bfloat16 row), so
  every load is coalesced and a chunk's loads are all in flight at once. It writes the chunk's
  output, its score maximum and its exponent sum. Chunks past the filled slots write an empty
  marker.
* `combine`: per (row, head), rescales the chunks to their common maximum and adds them up.

Grouped-query heads read their kv head (`REP` query heads per kv head). Everywhere else (a CPU,
Metal, a head size or dtype the kernel does not take, `PYMLXC_DECODE_KERNEL=0`) `attend` is the
same attention through `mx.fast.scaled_dot_product_attention` with an additive mask over the
buffer; the tests compare the two on a GPU.
"""
from __future__ import annotations

import os
import struct
import threading
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array

ENV_VAR = "PYMLXC_DECODE_KERNEL"
CHUNK = 128  # buffer slots per block of the partial kernel (one per thread)
THREADS = 128
_DTYPES = (mx.bfloat16, mx.float16, mx.float32)

# Loads of 16 bytes (8 half-precision or 4 float32 features) widened to float32 in registers, one
# per dtype (a kernel's header carries only its own).
_LOADS = {
    mx.bfloat16: """
__device__ __forceinline__ void pymlxc_load16(const __nv_bfloat16* p, float* o) {
    const uint4 r = *reinterpret_cast<const uint4*>(p);
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[2 * i] = __uint_as_float(w[i] << 16);
        o[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}""",
    mx.float16: """
__device__ __forceinline__ void pymlxc_load16(const __half* p, float* o) {
    const uint4 r = *reinterpret_cast<const uint4*>(p);
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[2 * i] = __half2float(__ushort_as_half((unsigned short)(w[i] & 0xffffu)));
        o[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(w[i] >> 16)));
    }
}""",
    mx.float32: """
__device__ __forceinline__ void pymlxc_load16(const float* p, float* o) {
    const float4 r = *reinterpret_cast<const float4*>(p);
    o[0] = r.x; o[1] = r.y; o[2] = r.z; o[3] = r.w;
}""",
}

# Both passes over the chunk read whole rows with all threads: TPR threads per row (16 bytes each),
# KPI rows at a time, every load coalesced and the chunk's loads unrolled.
_PARTIAL = """
    constexpr int VEC = 16 / sizeof(T);   // features per 16-byte load
    constexpr int TPR = D / VEC;          // threads per key row
    constexpr int KPI = THREADS_ / TPR;   // rows per pass of the block
    constexpr int NW = THREADS_ / 32;
    const float NEG_INF = __int_as_float(0xff800000);
    __shared__ float ps[CHUNK_];
    __shared__ float red[NW];
    __shared__ float accs[KPI * D];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int row = tid / TPR, sub = tid - row * TPR;
    const int split = blockIdx.x, bh = blockIdx.y;
    const int b = bh / HQ, h = bh - b * HQ, kvh = h / REP;
    int n = pos[0] + 1;
    if (n > keys_shape[2]) n = keys_shape[2];
    const int start = split * CHUNK_;
    const int end = min(start + CHUNK_, n);
    float* po = part_o + ((size_t)bh * NS + split) * D;
    float* pml = part_ml + ((size_t)bh * NS + split) * 2;
    if (start >= end) {
        for (int d = tid; d < D; d += THREADS_) po[d] = 0.0f;
        if (tid == 0) { pml[0] = NEG_INF; pml[1] = 0.0f; }
        return;
    }
    // This thread's VEC features of q, scaled.
    const T* qp = q + (size_t)b * q_strides[0] + (size_t)h * q_strides[1];
    float qv[VEC];
    #pragma unroll
    for (int j = 0; j < VEC; ++j) qv[j] = static_cast<float>(qp[(sub * VEC + j) * q_strides[3]]) * SCALE;
    const T* kb = keys + (size_t)b * keys_strides[0] + (size_t)kvh * keys_strides[1] + sub * VEC;
    #pragma unroll
    for (int i = 0; i < CHUNK_ / KPI; ++i) {
        const int k = start + i * KPI + row;
        float s = 0.0f;
        if (k < end) {
            float kv[VEC];
            pymlxc_load16(kb + (size_t)k * keys_strides[2], kv);
            #pragma unroll
            for (int j = 0; j < VEC; ++j) s += qv[j] * kv[j];
        }
        #pragma unroll
        for (int o = TPR / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (sub == 0 && i * KPI + row < CHUNK_) ps[i * KPI + row] = s;
    }
    __syncthreads();
    float m_loc = NEG_INF;
    for (int k = start + tid; k < end; k += THREADS_) m_loc = fmaxf(m_loc, ps[k - start]);
    for (int o = 16; o > 0; o >>= 1) m_loc = fmaxf(m_loc, __shfl_xor_sync(0xffffffffu, m_loc, o));
    if (lane == 0) red[warp] = m_loc;
    __syncthreads();
    float m = red[0];
    #pragma unroll
    for (int w = 1; w < NW; ++w) m = fmaxf(m, red[w]);
    __syncthreads();
    float l_loc = 0.0f;
    for (int k = start + tid; k < end; k += THREADS_) {
        const float e = __expf(ps[k - start] - m);
        ps[k - start] = e;
        l_loc += e;
    }
    for (int o = 16; o > 0; o >>= 1) l_loc += __shfl_xor_sync(0xffffffffu, l_loc, o);
    if (lane == 0) red[warp] = l_loc;
    __syncthreads();
    float l = 0.0f;
    #pragma unroll
    for (int w = 0; w < NW; ++w) l += red[w];
    const T* vb = values + (size_t)b * values_strides[0] + (size_t)kvh * values_strides[1] + sub * VEC;
    float acc[VEC];
    #pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
    #pragma unroll
    for (int i = 0; i < CHUNK_ / KPI; ++i) {
        const int k = start + i * KPI + row;
        if (k < end) {
            const float e = ps[k - start];
            float vv[VEC];
            pymlxc_load16(vb + (size_t)k * values_strides[2], vv);
            #pragma unroll
            for (int j = 0; j < VEC; ++j) acc[j] += e * vv[j];
        }
    }
    #pragma unroll
    for (int j = 0; j < VEC; ++j) accs[row * D + sub * VEC + j] = acc[j];
    __syncthreads();
    for (int d = tid; d < D; d += THREADS_) {
        float s = 0.0f;
        #pragma unroll
        for (int r = 0; r < KPI; ++r) s += accs[r * D + d];
        po[d] = s;
    }
    if (tid == 0) { pml[0] = m; pml[1] = l; }
"""

_COMBINE = """
    const float NEG_INF = __int_as_float(0xff800000);
    const int bh = blockIdx.y;
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    const float* ml = part_ml + (size_t)bh * NS * 2;
    float m = NEG_INF;
    for (int s = 0; s < NS; ++s) m = fmaxf(m, ml[2 * s]);
    const float* po = part_o + (size_t)bh * NS * D + d;
    float l = 0.0f, o = 0.0f;
    for (int s = 0; s < NS; ++s) {
        const float ms = ml[2 * s];
        if (ms == NEG_INF) continue;
        const float w = __expf(ms - m);
        l += w * ml[2 * s + 1];
        o += w * po[(size_t)s * D];
    }
    out[(size_t)bh * D + d] = static_cast<T>(o / l);
"""


def _float_literal(x: float) -> str:
    """A CUDA expression for `x` rounded to float32, exactly (no decimal round trip)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return f"__int_as_float(0x{bits:08x})"


def _compact(source: str) -> str:
    """The source without indentation, blank lines and comment lines: MLX hashes a custom kernel's
    whole source each time it encodes one, so a shorter source is a cheaper node."""
    lines = (line.split("//")[0].strip() for line in source.splitlines())  # the kernels hold no "//" in code
    return "\n".join(line for line in lines if line)


class _Kernels:
    """The kernel pair for one softmax scale and dtype (both baked into the source); MLX compiles
    them on first use."""

    def __init__(self, scale: float, dtype: Any) -> None:
        head = f"constexpr int THREADS_ = {THREADS};\nconstexpr int CHUNK_ = {CHUNK};\n" \
               f"const float SCALE = {_float_literal(scale)};\n"
        self.partial = mx.fast.cuda_kernel("pymlxc_attn_part", ["q", "keys", "values", "pos"], ["part_o", "part_ml"],
                                           _compact(head + _PARTIAL), header=_compact(_LOADS[dtype]),
                                           ensure_row_contiguous=False)
        self.combine = mx.fast.cuda_kernel("pymlxc_attn_sum", ["part_o", "part_ml"], ["out"], _compact(_COMBINE))


_kernels: dict[tuple[float, Any], _Kernels] = {}
_lock = threading.Lock()
_cuda: bool | None = None


def kernel_available() -> bool:
    """Whether `attend` can run its CUDA kernel here: MLX's CUDA build with a GPU as the default
    device, and not turned off with PYMLXC_DECODE_KERNEL=0."""
    global _cuda
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if mx.default_device().type != "gpu":
        return False
    if _cuda is None:
        _cuda = mx.cuda_available()
    return _cuda


def supports(dtype: Any, head_dim: int) -> bool:
    """Whether the kernel takes queries and keys of `dtype` with `head_dim` features (rows of whole
    16-byte loads, at most one warp per row)."""
    if dtype not in _DTYPES or head_dim not in (32, 64, 128, 256):
        return False
    return dtype != mx.float32 or head_dim <= 128  # threads per row: a power of two, at most a warp


def _by_kernel(q: Array, keys: Array, values: Array, pos: Array, scale: float) -> Array:
    b, hq, _, d = q.shape
    hkv = keys.shape[1]
    ns = -(-keys.shape[2] // CHUNK)
    with _lock:
        k = _kernels.get((scale, q.dtype))
        if k is None:
            k = _kernels[(scale, q.dtype)] = _Kernels(scale, q.dtype)
    rows = b * hq
    part_o, part_ml = k.partial(
        [q, keys, values, pos], output_shapes=[(rows, ns, d), (rows, ns, 2)],
        output_dtypes=[mx.float32, mx.float32], grid=(THREADS * ns, rows, 1), threadgroup=(THREADS, 1, 1),
        template=[("T", q.dtype), ("D", d), ("REP", hq // hkv), ("HQ", hq), ("NS", ns)])
    (out,) = k.combine([part_o, part_ml], output_shapes=[(b, hq, 1, d)], output_dtypes=[q.dtype],
                       grid=(d, rows, 1), threadgroup=(d, 1, 1), template=[("T", q.dtype), ("D", d), ("NS", ns)])
    return out


def by_mask(q: Array, keys: Array, values: Array, pos: Array, scale: float) -> Array:
    """The same attention through MLX's attention with an additive mask (slot <= pos visible)."""
    slots = keys.shape[2]
    visible = mx.arange(slots, dtype=mx.int32) <= pos
    mask = mx.where(visible, mx.array(0.0, q.dtype), mx.array(float("-inf"), q.dtype))
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def attend(q: Array, keys: Array, values: Array, pos: Array, scale: float) -> Array:
    """softmax(q k^T * scale) v over slots 0..min(pos, S - 1) of `keys`/`values` [B, Hkv, S, D],
    for one query token `q` [B, Hq, 1, D] (Hq a multiple of Hkv); `pos` an int32 scalar array."""
    b, hq, length, d = q.shape
    if (length == 1 and kernel_available() and supports(q.dtype, d) and keys.dtype == q.dtype
            and values.dtype == q.dtype and values.shape[3] == d and hq % keys.shape[1] == 0):
        return _by_kernel(q, keys, values, pos, float(scale))
    return by_mask(q, keys, values, pos, scale)


__all__ = ["attend", "by_mask", "kernel_available", "supports", "CHUNK", "ENV_VAR"]
