"""Layouts of the 4-bit matrix-vector product measured outside MLX (CuPy), at the decode step's real
shapes: where a kernel's time goes before its design is changed in `backends/metal/kernels/matvec.py`.

`probe_matvec.py` measures the kernel as MLX runs it; this probe compares ways to split the work,
each a complete CUDA kernel over MLX's affine 4-bit layout (uint32 words of 8 nibbles, a bfloat16
scale and bias per group), timed as a CUDA graph of back-to-back calls over distinct copies of the
weights (together past the L2 cache), as a decode step's graph runs them:

* `ours`: pymlxc's kernel (`matvec.QUANTIZED_SOURCE`, plain form, one row of x, its own launch);
* `warp2`: the float form it replaced: a warp per two output rows, each lane a 16-byte chunk of both
  rows per step along K, the nibbles turned into floats through the mantissa;
* `sk_rB`: a block of 128 threads per B output rows, K split over the block's threads (each thread
  the same chunks of the B rows, all B loads issued together), the warps' sums added in shared memory;
* `skf16_rB`: the same split with each thread rounding its chunk of x to int16 and multiplying by
  `dp2a` (the design `ours` took, at its B);
* `skq16_rB`: as `skf16_rB` with x rounded by a kernel of its own before (`quant16`);
* `skq_rB`: the same split with x quantized to int8 per 32 values (a scale and the float sum of
  each 32) and the nibbles multiplied by `dp4a` (llama.cpp's MMVQ idea); `quant` is that
  quantization of x alone, a kernel of its own here;
* `read`: a streaming read of the same bytes (16-byte loads, grid-stride), the ceiling of a read.

`error` is each kernel's largest difference from a float32 reference over the largest reference
value. Run on a machine with CuPy and a CUDA GPU:

    python benchmarks/profile/probe_matvec_variants.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
from _matvec import SHAPES, load_matvec

matvec = load_matvec()
THREADS = 128

PRELUDE = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef unsigned int uint32_t;
namespace mlx { namespace core { namespace cu {
struct Multiply { template <typename A> __device__ A operator()(A a, A b) const { return a * b; } };
struct Sigmoid {
  template <typename A> __device__ A operator()(A a) const { return A(1.f / (1.f + __expf(-static_cast<float>(a)))); }
};
}}}
"""

VARIANTS = r"""
// pymlxc's kernel as MLX wraps it (its plain form): the weight's rows as a kernel parameter.
template <typename T, int M, int G, int KC, int S, int U, bool PAIR>
__global__ void ours(const T* x, const uint32_t* w, const T* scales, const T* biases, T* out, int w_shape0) {
OURS_BODY
}

// sum_i x[i] * (1 + q_i / 16) over the 8 nibbles of a word (nibble i in bits 4i..4i+3): a nibble q
// placed in the mantissa of 1.0 is the float 1 + q / 16.
__device__ __forceinline__ float biased_dot8(uint32_t word, const float* x) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint32_t placed = (i <= 4) ? (word << (19 - 4 * i)) : (word >> (4 * i - 19));
    s = fmaf(x[i], __uint_as_float((placed & 0x00780000u) | 0x3F800000u), s);
  }
  return s;
}

// The float form with a warp per two output rows (pymlxc's kernel before the split over K): each
// lane a 16-byte chunk of both rows per step, float sums of x * (1 + q / 16).
template <typename T, int G>
__global__ void warp2(const T* __restrict__ x, const uint4* __restrict__ w, const T* __restrict__ scales,
                      const T* __restrict__ biases, T* __restrict__ out, int N, int CHUNKS) {
  const int K = CHUNKS * 32, GROUPS = K / G, ITERS = (CHUNKS + 31) / 32;
  const int lane = threadIdx.x & 31;
  const int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * 2;
  if (row0 >= N) return;
  float acc[2] = {0.f, 0.f};
#pragma unroll 2
  for (int it = 0; it < ITERS; ++it) {
    const int c = it * 32 + lane;
    if (c >= CHUNKS) break;
    const int g = (c * 32) / G;
    uint4 q[2];
    float sc[2], bi[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const size_t row = min(row0 + r, N - 1);
      q[r] = w[row * CHUNKS + c];
      sc[r] = static_cast<float>(scales[row * GROUPS + g]);
      bi[r] = static_cast<float>(biases[row * GROUPS + g]);
    }
    float xf[32];
#pragma unroll
    for (int j = 0; j < 4; ++j) pymlxc_mv::load8(x + c * 32 + 8 * j, xf + 8 * j);
    float xs = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) xs += xf[i];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float d = biased_dot8(q[r].x, xf) + biased_dot8(q[r].y, xf + 8) + biased_dot8(q[r].z, xf + 16) +
                      biased_dot8(q[r].w, xf + 24);
      acc[r] += 16.f * sc[r] * d + (bi[r] - 16.f * sc[r]) * xs;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float v = pymlxc_mv::warp_sum(acc[r]);
    if (lane == 0 && row0 + r < N) out[row0 + r] = static_cast<T>(v);
  }
}

// A block of TPB threads per RB output rows; thread t takes chunks t, t + TPB, ... of each row, the
// rows' loads issued together, the warps' sums added in shared memory. MODE, the arithmetic of a
// chunk: 0 floats (x * (1 + q / 16) through the mantissa, as `warp2`), 1 x as int8 from `quant`
// and dp4a, 2 x as int16 from `quant16` and dp2a, 3 x rounded to int16 by each thread and dp2a.
// xa: x (modes 0 and 3) or its quantized values (1, 2); xds: their (scale, sum) per 32 (1, 2).
template <typename T, int G, int RB, int KC, int TPB, int MODE>
__global__ void split(const void* __restrict__ xa, const float2* __restrict__ xds, const uint4* __restrict__ w,
                      const T* __restrict__ scales, const T* __restrict__ biases, T* __restrict__ out, int N) {
  constexpr int GROUPS = KC * 32 / G;
  constexpr int ITERS = (KC + TPB - 1) / TPB;
  const int t = threadIdx.x, lane = t & 31, wid = t >> 5;
  const int row0 = blockIdx.x * RB;
  float acc[RB];
#pragma unroll
  for (int r = 0; r < RB; ++r) acc[r] = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = it * TPB + t;
    if (KC % TPB != 0 && c >= KC) continue;
    const int g = (c * 32) / G;
    uint4 q[RB];
    float sc[RB], bi[RB];
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      const size_t row = min(row0 + r, N - 1);
      q[r] = w[row * KC + c];
      sc[r] = static_cast<float>(scales[row * GROUPS + g]);
      bi[r] = static_cast<float>(biases[row * GROUPS + g]);
    }
    if constexpr (MODE == 0 || MODE == 3) {
      float xf[32];
#pragma unroll
      for (int j = 0; j < 4; ++j) pymlxc_mv::load8(static_cast<const T*>(xa) + c * 32 + 8 * j, xf + 8 * j);
      if constexpr (MODE == 0) {
        float xs = 0.f;
#pragma unroll
        for (int i = 0; i < 32; ++i) xs += xf[i];
#pragma unroll
        for (int r = 0; r < RB; ++r) {
          const float d = biased_dot8(q[r].x, xf) + biased_dot8(q[r].y, xf + 8) + biased_dot8(q[r].z, xf + 16) +
                          biased_dot8(q[r].w, xf + 24);
          acc[r] += 16.f * sc[r] * d + (bi[r] - 16.f * sc[r]) * xs;
        }
      } else {
        int xi[16];
        float xs;
        const float d = pymlxc_mv::quantize32(xf, xi, xs);
#pragma unroll
        for (int r = 0; r < RB; ++r) acc[r] += sc[r] * d * static_cast<float>(pymlxc_mv::dot32(q[r], xi)) + bi[r] * xs;
      }
    } else if constexpr (MODE == 1) {
      const int4 a = static_cast<const int4*>(xa)[2 * c], b = static_cast<const int4*>(xa)[2 * c + 1];
      const float2 ds = xds[c];
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        const unsigned words[4] = {q[r].x, q[r].y, q[r].z, q[r].w};
        const int xw[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        int sum = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          sum = __dp4a(static_cast<int>(words[j] & 0x0F0F0F0Fu), xw[2 * j], sum);
          sum = __dp4a(static_cast<int>((words[j] >> 4) & 0x0F0F0F0Fu), xw[2 * j + 1], sum);
        }
        acc[r] += sc[r] * ds.x * static_cast<float>(sum) + bi[r] * ds.y;
      }
    } else {
      int xi[16];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        *reinterpret_cast<int4*>(xi + 4 * j) = static_cast<const int4*>(xa)[4 * c + j];
      }
      const float2 ds = xds[c];
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        acc[r] += sc[r] * ds.x * static_cast<float>(pymlxc_mv::dot32(q[r], xi)) + bi[r] * ds.y;
      }
    }
  }
  __shared__ float part[TPB / 32][RB];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const float v = pymlxc_mv::warp_sum(acc[r]);
    if (lane == 0) part[wid][r] = v;
  }
  __syncthreads();
  if (t < RB && row0 + t < N) {
    float v = 0.f;
#pragma unroll
    for (int i = 0; i < TPB / 32; ++i) v += part[i][t];
    out[row0 + t] = static_cast<T>(v);
  }
}

// x rounded to Q (int8 with LIMIT 127, int16 with 32767) per 32 values, a warp per 32, in the order
// the split kernel's nibbles take them: four int8 or two int16 values of one word's even or odd
// nibbles to an int (int8: word j's even nibbles in int 2j, odd in 2j + 1; int16: (0, 2), (4, 6),
// (1, 3), (5, 7) in ints 4j .. 4j + 3; both put value e at (e / 8) 8 + (e % 2) 4 + (e % 8) / 2).
// xds[c] = (scale, sum of the 32 values).
template <typename T, typename Q, int KC, int LIMIT>
__global__ void quantize_x(const T* __restrict__ x, Q* __restrict__ xq, float2* __restrict__ xds) {
  const int c = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), e = threadIdx.x & 31;
  if (c >= KC) return;
  const float v = static_cast<float>(x[c * 32 + e]);
  float amax = fabsf(v);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float s = pymlxc_mv::warp_sum(v);
  const float inv = amax > 0.f ? LIMIT / amax : 0.f;
  xq[c * 32 + (e / 8) * 8 + (e % 2) * 4 + (e % 8) / 2] = static_cast<Q>(__float2int_rn(v * inv));
  if (e == 0) xds[c] = make_float2(amax / LIMIT, s);
}

// The bytes of a product read with 16-byte loads, grid-stride: what a read of them can reach.
extern "C" __global__ void read_all(const uint4* __restrict__ p, long long n, unsigned* __restrict__ sink) {
  unsigned v = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const uint4 u = p[i];
    v ^= u.x ^ u.y ^ u.z ^ u.w;
  }
  if (v == 0x9e3779b9u) sink[0] = v;
}
"""


def source() -> str:
    ours = matvec.QUANTIZED_SOURCE.replace("w_shape[0]", "w_shape0")
    return PRELUDE + matvec.HEADER + VARIANTS.replace("OURS_BODY", ours)


def tpb(k: int) -> int:
    """Threads along K for rows of length k: the kernel's own rule (`matvec.row_groups`)."""
    return THREADS // matvec.row_groups(k)


MODES = {"sk": 0, "skq": 1, "skq16": 2, "skf16": 3}  # split's arithmetic (its MODE) by variant name


def names(shapes: list[tuple[int, int]], group: int, rows: list[int]) -> dict[str, str]:
    """Template instantiations by key."""
    out: dict[str, str] = {"warp2": f"warp2<__nv_bfloat16, {group}>"}
    for k, _ in shapes:
        kc = k // 32
        groups = matvec.row_groups(k)
        units = matvec.units_per_block(k) // groups
        out[f"ours.{k}"] = f"ours<__nv_bfloat16, 1, {group}, {kc}, {groups}, {units}, false>"
        out[f"quant.{k}"] = f"quantize_x<__nv_bfloat16, signed char, {kc}, 127>"
        out[f"quant16.{k}"] = f"quantize_x<__nv_bfloat16, short, {kc}, 32767>"
        for rb in rows:
            for variant, mode in MODES.items():
                out[f"{variant}_r{rb}.{k}"] = f"split<__nv_bfloat16, {group}, {rb}, {kc}, {tpb(k)}, {mode}>"
    return out


def to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (round to nearest even) as uint16."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(u: np.ndarray) -> np.ndarray:
    return (u.astype(np.uint32) << 16).view(np.float32)


class Timer:
    """Microseconds per call of a launch, as a CUDA graph of `calls` calls cycling over `copies`
    sets of weights (their index is the launch's argument), the median of `repeats` replays."""

    def __init__(self, cp: Any, calls: int, repeats: int) -> None:
        self.cp, self.calls, self.repeats = cp, calls, repeats
        self.stream = cp.cuda.Stream(non_blocking=True)

    def __call__(self, launch: Any, copies: int) -> float:
        cp, stream = self.cp, self.stream
        calls = max(self.calls, copies)
        with stream:
            stream.begin_capture()
            for i in range(calls):
                launch(i % copies)
            graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(self.repeats):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1000 / calls)
        return statistics.median(times)


def probe_shape(cp: Any, fn: dict[str, Any], read_fn: Any, timer: Timer, k: int, n: int, g: int, rows: list[int],
                min_bytes: float, rng: np.random.Generator) -> dict[str, Any]:
    """Every variant on one weight shape: time per call, GB/s of weights, error against float32."""
    kc, groups = k // 32, k // g
    wbytes = n * k // 2 + 2 * 2 * n * groups
    copies = max(1, int(-(-min_bytes // wbytes)))
    xb = to_bf16(rng.standard_normal(k).astype(np.float32))
    wq = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    sc = to_bf16(rng.uniform(0.002, 0.02, size=(n, groups)).astype(np.float32))
    bi = to_bf16(-8 * from_bf16(sc) * rng.uniform(0.8, 1.2, size=(n, groups)).astype(np.float32))
    shifts = 4 * np.arange(8, dtype=np.uint32)
    codes = ((wq[:, :, None] >> shifts) & 0xF).reshape(n, k).astype(np.float32)
    ref = (codes * np.repeat(from_bf16(sc), g, axis=1) + np.repeat(from_bf16(bi), g, axis=1)) @ from_bf16(xb)
    del codes
    x = cp.asarray(xb)
    ws, ss, bs = [cp.asarray(wq)], [cp.asarray(sc)], [cp.asarray(bi)]
    for _ in range(1, copies):  # distinct buffers: together past the L2 cache
        ws.append(ws[0].copy())
        ss.append(ss[0].copy())
        bs.append(bs[0].copy())
    out = cp.zeros(n, dtype=cp.uint16)
    xq = cp.zeros(k, dtype=cp.int8)
    xq16 = cp.zeros(k, dtype=cp.int16)
    xds = cp.zeros(2 * kc, dtype=cp.float32)
    row: dict[str, Any] = {"K": k, "N": n, "copies": copies, "weight_mb": round(wbytes / 1e6, 2),
                           "us_per_call": {}, "gbps": {}, "error": {}}

    def record(key: str, us: float) -> None:
        row["us_per_call"][key] = round(us, 2)
        row["gbps"][key] = round(wbytes / us / 1e3, 1)
        got = from_bf16(cp.asnumpy(out))
        row["error"][key] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))

    def split_call(kernel: Any, blocks: int, threads: int, lead: tuple[Any, ...]) -> Any:
        return lambda i: kernel((blocks,), (threads,), (*lead, ws[i], ss[i], bs[i], out, np.int32(n)))

    warps = -(-n // 2)
    warp2, warp_blocks = fn["warp2"], -(-warps * 32 // THREADS)
    record("warp2", timer(lambda i: warp2((warp_blocks,), (THREADS,),
                                          (x, ws[i], ss[i], bs[i], out, np.int32(n), np.int32(kc))), copies))
    ours, geo = fn[f"ours.{k}"], matvec.launch(1, k, n, "bfloat16", g)
    record("ours", timer(lambda i: ours((geo["grid"][0] // THREADS,), (THREADS,),
                                        (x, ws[i], ss[i], bs[i], out, np.int32(n))), copies))
    quant, quant16 = fn[f"quant.{k}"], fn[f"quant16.{k}"]
    row["us_per_call"]["quant"] = round(timer(lambda i: quant((-(-kc // 4),), (THREADS,), (x, xq, xds)), 1), 2)
    row["us_per_call"]["quant16"] = round(timer(lambda i: quant16((-(-kc // 4),), (THREADS,), (x, xq16, xds)), 1), 2)
    inputs = {"sk": x, "skq": xq, "skq16": xq16, "skf16": x}
    for variant in MODES:
        if variant == "skq":  # xds: the scales of this variant's rounding of x
            quant((-(-kc // 4),), (THREADS,), (x, xq, xds))
        elif variant == "skq16":
            quant16((-(-kc // 4),), (THREADS,), (x, xq16, xds))
        for rb in rows:
            record(f"{variant}_r{rb}", timer(split_call(fn[f"{variant}_r{rb}.{k}"], -(-n // rb), tpb(k),
                                                    (inputs[variant], xds)), copies))
    # the read ceiling: the packed weights alone (scales and biases are 1/9 of the bytes at group 64)
    sink = cp.zeros(4, dtype=cp.uint32)
    n16 = ws[0].nbytes // 16
    us = timer(lambda i: read_fn((132 * 8,), (256,), (ws[i], np.int64(n16), sink)), copies)
    row["us_per_call"]["read"] = round(us, 2)
    row["gbps"]["read"] = round(ws[0].nbytes / us / 1e3, 1)
    return row


def main() -> None:
    import cupy as cp  # noqa: PLC0415 - the GPU machine's; importing the module needs no GPU

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="output rows per block (sk, skq)")
    ap.add_argument("--bytes", type=float, default=400e6, help="weight bytes the copies of one shape hold")
    ap.add_argument("--calls", type=int, default=240, help="calls per graph (at least one per copy)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    g = args.group_size
    shapes = [SHAPES[s] for s in args.shapes]
    keys = names(shapes, g, args.rows)
    module = cp.RawModule(code=source(), options=("--std=c++17",), name_expressions=list(keys.values()))
    fn = {key: module.get_function(expr) for key, expr in keys.items()}
    read_fn = module.get_function("read_all")
    rng = np.random.default_rng(0)
    timer = Timer(cp, args.calls, args.repeats)
    results: dict[str, Any] = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                               "group_size": g, "dtype": "bfloat16", "probes": {}}
    for name, (k, n) in zip(args.shapes, shapes, strict=True):
        row = probe_shape(cp, fn, read_fn, timer, k, n, g, args.rows, args.bytes, rng)
        results["probes"][name] = row
        cp.get_default_memory_pool().free_all_blocks()
        line = " ".join(f"{key} {us:.1f}us/{row['gbps'].get(key, 0):.0f}" for key, us in row["us_per_call"].items())
        print(f"{name} K={k} N={n} {row['weight_mb']} MB x{row['copies']}: {line}", flush=True)
        print("   error " + " ".join(f"{key} {v:.1e}" for key, v in row["error"].items()), flush=True)
    (args.out / "probe_matvec_variants.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
