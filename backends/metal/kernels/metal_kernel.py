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


__all__ = ["MetalKernel", "SharedMetalKernel", "device_kind"]
