"""First-call latency of pymlxc's 4-bit matvec kernel, through MLX's own Python API.

NVRTC compiles the kernel once per template (dtype, rows of x, group size, rows per warp); the
weight shapes are read at run time, so a model's linears share one compile. Each line gives the
first call's time (with the compile, if any) and the error against MLX's `quantized_matmul`.

    python benchmarks/probe_matvec_compile.py    (on the GPU machine; needs no libmlxc)
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

_spec = importlib.util.spec_from_file_location(
    "cuda_matvec", Path(__file__).resolve().parents[1] / "backends" / "metal" / "cuda_matvec.py")
kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernels)

CALLS = ((1, 4096, 6144), (1, 14336, 4096), (1, 4096, 28672), (2, 4096, 6144), (1, 2048, 3000))  # (M, K, N)


def first_call(kernel: Any, m: int, k: int, n: int) -> tuple[float, float]:
    """(ms of the first call, largest difference from MLX over MLX's largest value)."""
    w, s, b = mx.quantize(mx.random.normal((n, k)).astype(mx.bfloat16), 64, 4)
    x = mx.random.normal((m, k)).astype(mx.bfloat16)
    mx.eval(w, s, b, x)
    t0 = time.perf_counter()
    y = kernel(inputs=[x, w, s, b], output_shapes=[(m, n)], output_dtypes=[x.dtype],
               **kernels.launch(m, k, n, x.dtype, 64))[0]
    mx.eval(y)
    ms = (time.perf_counter() - t0) * 1e3
    ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4).astype(mx.float32)
    return ms, float(mx.abs(y.astype(mx.float32) - ref).max() / mx.abs(ref).max())


def main() -> None:
    kernel = mx.fast.cuda_kernel(kernels.QUANTIZED_NAME, list(kernels.QUANTIZED_INPUTS), list(kernels.OUTPUT_NAMES),
                                 kernels.QUANTIZED_SOURCE, header=kernels.HEADER)
    for m, k, n in CALLS:
        ms, err = first_call(kernel, m, k, n)
        print(f"M={m} K={k} N={n}: first call {ms:.1f} ms, rel err vs MLX {err:.1e}")


if __name__ == "__main__":
    main()
