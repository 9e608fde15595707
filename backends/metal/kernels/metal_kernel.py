"""`mx.fast.metal_kernel` for pymlxc: a custom Metal kernel as an MLX operation (Apple GPUs only).

pymlxc.core exposes `cuda_kernel`; mlx-c has the Metal twin with the same configuration calls, so
this wrapper is `pymlxc.core.cuda_kernel.FastKernel` on `mlx_fast_metal_kernel_*`. MLX writes
the signature (`device const T* <input>`, `<input>_shape` ... when the body names them, `device T*
<output>`, and the `[[thread_position_in_grid]]`-style attributes the body uses) and compiles the
body the first time it runs with a set of template arguments. Applying it where Metal is missing
raises an MLXError with MLX's message.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pymlxc.core as mx
from pymlxc.core.array import Array
from pymlxc.core.cuda_kernel import FastKernel, TemplateValue


class MetalKernel(FastKernel):
    """A named Metal kernel body with its input and output names; call it to apply it to arrays."""

    api = "metal"
    label = "Metal"

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True) -> None:
        super().__init__(name, name, input_names, output_names, source, header, ensure_row_contiguous, False)

    def __call__(self, inputs: Sequence[Array], *, output_shapes: Sequence[Sequence[int]],
                 output_dtypes: Sequence[Any], grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                 template: Sequence[tuple[str, TemplateValue]] = ()) -> list[Array]:
        return self._apply(inputs, output_shapes, output_dtypes, grid, threadgroup, template, None, None)


def dialect(body: str, cuda: bool) -> str:
    """A kernel body shared by the CUDA and Metal kernels of a family, written out for one of them:
    `WARP_SUM x` lines sum x over the warp (shuffles) / SIMD group (`simd_sum`), `DEVICE ` marks
    Metal's address space of a pointer; Metal drops the `#pragma unroll` lines and writes `fma`
    for CUDA's `fmaf`. The rest is C++ that both compilers take."""
    lines = []
    for line in body.splitlines(keepends=True):
        indent, words = line[:len(line) - len(line.lstrip())], line.split()
        if words[:1] == ["WARP_SUM"]:
            x = words[1]
            lines += ([f"{indent}for (int off = 16; off > 0; off >>= 1) {{\n",
                       f"{indent}  {x} += __shfl_xor_sync(0xffffffffu, {x}, off);\n", f"{indent}}}\n"]
                      if cuda else [f"{indent}{x} = simd_sum({x});\n"])
        elif cuda:
            lines.append(line.replace("DEVICE ", ""))
        elif words != ["#pragma", "unroll"]:
            lines.append(line.replace("DEVICE ", "device ").replace("fmaf(", "fma("))
    return "".join(lines)


def device_kind() -> str | None:
    """"cuda" or "metal" where MLX's default device is that GPU, else None (the CPU: MLX ops)."""
    if mx.default_device().type != "gpu":
        return None
    if mx.cuda_available():
        return "cuda"
    return "metal" if mx.metal_available() else None


class SharedMetalKernel:
    """A Metal kernel made on first use and kept for the process (as `mx.fast.SharedKernel`)."""

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                 header: str = "") -> None:
        self._args = (name, tuple(input_names), tuple(output_names), source, header)
        self._lock = threading.Lock()
        self._kernel: MetalKernel | None = None

    def __call__(self) -> MetalKernel:
        with self._lock:
            if self._kernel is None:
                self._kernel = MetalKernel(*self._args)
            return self._kernel


__all__ = ["MetalKernel", "SharedMetalKernel", "device_kind", "dialect"]
