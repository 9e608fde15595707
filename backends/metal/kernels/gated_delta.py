"""Gated DeltaNet's recurrence as one fused kernel, on CUDA and on Metal.

One warp (CUDA) or SIMD group (Metal) of 32 threads owns one row of one head's state: each thread
holds Dk / 32 of the row's entries in registers for all T tokens, so the state is read once and
written once per call instead of once per operation. Per token a thread decays its entries, the
row's recall S k is summed across the warp, the delta written back, and S q summed the same way.
Layout: q, k [B, T, Hk, Dk] (heads shared by Hv / Hk value heads), v [B, T, Hv, Dv], g, beta [B,
T, Hv] float32, state [B, Hv, Dv, Dk] float32; outputs y [B, T, Hv, Dv] (q's dtype) and the state.
Launch: grid (32, Dv, B * Hv) threads in groups of (32, ROWS, 1); Dk a multiple of 32.

The model decodes through `run` (one token per call); prefill takes the chunked MLX form
(models/gated_delta.py), whose matrix products beat a per-token loop on long prompts. `ready`
compares the kernel with the MLX ops once per process and shape (`compare`, through
check.CheckedOnce), and keeps the ops with a warning where it cannot run or disagrees.
The CUDA source is compiled by nvcc in the tests; neither kernel has run on a GPU in them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core.cuda_kernel import SharedKernel

from .check import CheckedOnce
from .metal_kernel import SharedMetalKernel, device_kind, dialect

ROWS = 4  # state rows (warps) per block / threadgroup
INPUTS = ("q", "k", "v", "g", "beta", "state_in")
OUTPUTS = ("y", "state_out")

# The token loop both kernels run (a thread's P entries of one state row), written out for each
# by `metal_kernel.dialect`.
_LOOP = r"""
  float s[P];
  #pragma unroll
  for (int i = 0; i < P; ++i) {
    s[i] = state_in[at + i];
  }
  for (int t = 0; t < T; ++t) {
    const float gt = g_[0];
    float recall = 0.0f;
    #pragma unroll
    for (int i = 0; i < P; ++i) {
      s[i] *= gt;
      recall += s[i] * static_cast<float>(k_[i]);
    }
    #pragma unroll
    WARP_SUM recall
    const float delta = (static_cast<float>(v_[row]) - recall) * beta_[0];
    float out = 0.0f;
    #pragma unroll
    for (int i = 0; i < P; ++i) {
      s[i] += static_cast<float>(k_[i]) * delta;
      out += s[i] * static_cast<float>(q_[i]);
    }
    #pragma unroll
    WARP_SUM out
    if (lane == 0) {
      y_[row] = static_cast<InT>(out);
    }
    q_ += Hk * Dk;
    k_ += Hk * Dk;
    v_ += Hv * Dv;
    y_ += Hv * Dv;
    g_ += Hv;
    beta_ += Hv;
  }
  #pragma unroll
  for (int i = 0; i < P; ++i) {
    state_out[at + i] = s[i];
  }
"""


# Template arguments: InT (q, k, v, y), Dk, Dv, Hk, Hv, T.
CUDA_SOURCE = r"""
  constexpr int P = Dk / 32;
  const int lane = threadIdx.x;
  const int row = blockIdx.y * blockDim.y + threadIdx.y;
  const int n = blockIdx.z;
  if (row >= Dv) {
    return;  // the whole warp: shuffles below stay within full warps
  }
  const int b = n / Hv;
  const int hv = n % Hv;
  const int hk = hv / (Hv / Hk);
  const InT* q_ = q + ((size_t)b * T * Hk + hk) * Dk + lane * P;
  const InT* k_ = k + ((size_t)b * T * Hk + hk) * Dk + lane * P;
  const InT* v_ = v + ((size_t)b * T * Hv + hv) * Dv;
  InT* y_ = y + ((size_t)b * T * Hv + hv) * Dv;
  const float* g_ = g + (size_t)b * T * Hv + hv;
  const float* beta_ = beta + (size_t)b * T * Hv + hv;
  const size_t at = ((size_t)n * Dv + row) * Dk + lane * P;""" + dialect(_LOOP, cuda=True)

# The same in Metal; MLX adds the attributes the body names (thread_position_in_grid, ...).
METAL_SOURCE = r"""
  constexpr int P = Dk / 32;
  const uint lane = thread_index_in_simdgroup;
  const uint row = thread_position_in_grid.y;
  const uint n = thread_position_in_grid.z;
  const uint b = n / Hv;
  const uint hv = n % Hv;
  const uint hk = hv / (Hv / Hk);
  auto q_ = q + (b * T * Hk + hk) * Dk + lane * P;
  auto k_ = k + (b * T * Hk + hk) * Dk + lane * P;
  auto v_ = v + (b * T * Hv + hv) * Dv;
  auto y_ = y + (b * T * Hv + hv) * Dv;
  auto g_ = g + b * T * Hv + hv;
  auto beta_ = beta + b * T * Hv + hv;
  const uint at = (n * Dv + row) * Dk + lane * P;""" + dialect(_LOOP, cuda=False)

_cuda = SharedKernel("pymlxc_gated_delta", INPUTS, OUTPUTS, CUDA_SOURCE)
_metal = SharedMetalKernel("pymlxc_gated_delta", INPUTS, OUTPUTS, METAL_SOURCE)

Ops = Callable[..., tuple[Array, Array]]


def applies(dk: int, dv: int, hk: int, hv: int) -> bool:
    """Shapes the kernel takes: Dk a multiple of 32 (a warp splits each row), Hk dividing Hv."""
    return dk >= 32 and dk % 32 == 0 and dv >= 1 and hk >= 1 and hv % hk == 0


def run(kind: str, q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array) -> tuple[Array, Array]:
    """y, new state through the `kind` ("cuda" / "metal") kernel (shapes and layout: module doc)."""
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2:]
    kernel = _cuda() if kind == "cuda" else _metal()
    y, out = kernel([q, k, v, g.astype(mx.float32), beta.astype(mx.float32), state.astype(mx.float32)],
                    output_shapes=[(b, t, hv, dv), (b, hv, dv, dk)], output_dtypes=[q.dtype, mx.float32],
                    grid=(32, dv, b * hv), threadgroup=(32, ROWS, 1),
                    template=[("InT", q.dtype), ("Dk", dk), ("Dv", dv), ("Hk", hk), ("Hv", hv), ("T", t)])
    return y, out


# ---------------------------------------------------------------------- checked once

_checks = CheckedOnce("the gated delta kernel")


def ready(dims: tuple[int, int, int, int, int], dtype: Any, ops: Ops) -> str | None:
    """The kernel kind to use for `dims` (Dk, Dv, Hk, Hv, T) and q/k/v of `dtype` here, once
    `compare` found it agreeing with `ops` (the MLX operations; run now, the first time), else None:
    use the operations (a RuntimeWarning said why)."""
    kind = device_kind()
    if kind is None or not applies(*dims[:4]):
        return None
    return kind if _checks.verdict((kind, *dims, str(dtype)), lambda: compare(kind, dims, dtype, ops)) else None


def compare(kind: str, dims: tuple[int, int, int, int, int], dtype: Any, ops: Ops,
            runner: Callable[..., tuple[Array, Array]] | None = None) -> str | None:
    """None where the kernel agrees with `ops(q, k, v, g, beta, state)` on random inputs of these
    dims (Dk, Dv, Hk, Hv, T) within float32 summation error plus `dtype`'s rounding of y, else how
    it differs; raises what running it raises. `runner` stands in for `run` (tests)."""
    dk, dv, hk, hv, t = dims
    rng = np.random.default_rng(0)
    b = 2

    def unit(shape: tuple[int, ...]) -> np.ndarray:
        x = rng.normal(size=shape).astype(np.float32)
        normed: np.ndarray = x / np.linalg.norm(x, axis=-1, keepdims=True)
        return normed

    q = mx.array(unit((b, t, hk, dk)) * dk**-0.5).astype(dtype)
    k = mx.array(unit((b, t, hk, dk))).astype(dtype)
    v = mx.array(rng.normal(size=(b, t, hv, dv)).astype(np.float32)).astype(dtype)
    g = mx.array(rng.uniform(0.5, 1.0, (b, t, hv)).astype(np.float32))
    beta = mx.array(rng.uniform(0.0, 1.0, (b, t, hv)).astype(np.float32))
    state = mx.array(rng.normal(size=(b, hv, dv, dk)).astype(np.float32))
    got_y, got_s = (runner or run)(kind, q, k, v, g, beta, state)
    want_y, want_s = ops(q, k, v, g, beta, state)
    got = [np.asarray(got_y.astype(mx.float32)), np.asarray(got_s)]
    want = [np.asarray(want_y.astype(mx.float32)), np.asarray(want_s)]
    y_tol = 1e-4 if dtype == mx.float32 else 2e-2
    for name, a, w, tol in (("y", got[0], want[0], y_tol), ("state", got[1], want[1], 1e-4)):
        if a.shape != w.shape:
            return f"its {name} has shape {a.shape}, MLX operations give {w.shape}"
        if not np.allclose(a, w, rtol=tol, atol=tol):
            return (f"it differs from MLX operations ({name}: largest difference {float(np.max(np.abs(a - w))):.3g} "
                    f"for dims {dims}, {dtype})")
    return None


__all__ = ["CUDA_SOURCE", "METAL_SOURCE", "applies", "compare", "device_kind", "ready", "run"]
