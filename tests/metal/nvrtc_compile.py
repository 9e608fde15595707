"""Compile pymlxc's CUDA kernel sources with NVRTC on a machine without a GPU.

MLX 0.32's `fast.cuda_kernel` compiles a kernel at its first call, on the GPU machine; a source that
does not compile fails only there. This wraps a source as MLX wraps it (its `custom_kernel.cpp`): a
device header, the kernel's own header, then inside `namespace mlx::core::cu` a `__global__`
function of the inputs (`const T* name`, and `name_shape` / `name_strides` / `name_ndim` where the
body names them) and the outputs, the template arguments as constants, and the body. The device
header here declares what pymlxc's kernels use of MLX's (`Shape`, `Strides`, `Limits`), and
`MLX_HEADERS` stands in for the MLX device headers a kernel's header includes by name (MLX hands
NVRTC its own), both written for these tests. NVRTC and the CUDA headers come from NVIDIA's wheels
(`nvidia-cuda-nvrtc-cu12`, `nvidia-cuda-runtime-cu12`, `nvidia-cuda-cccl-cu12`); `available()` says
whether they are installed.
"""
from __future__ import annotations

import ctypes
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ARCH = "compute_90"  # the H100 / H200

DEVICE_HEADER = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cooperative_groups.h>
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
template <typename U> struct Limits {
  __device__ static constexpr U max() { return cuda::std::numeric_limits<U>::max(); }
  __device__ static constexpr U min() { return cuda::std::numeric_limits<U>::lowest(); }
  __device__ static constexpr U finite_max() { return cuda::std::numeric_limits<U>::max(); }
  __device__ static constexpr U finite_min() { return cuda::std::numeric_limits<U>::lowest(); }
};
}  // namespace mlx::core::cu
"""

# MLX's device headers that pymlxc's kernel headers include, by the names MLX gives NVRTC: the
# operations they use (the matvec kernel's paired form: `Multiply`, `Sigmoid`), with MLX's signatures.
MLX_HEADERS = {
    "mlx/backend/cuda/device/unary_ops.cuh": r"""
#pragma once
namespace mlx::core::cu {
struct Sigmoid {
  template <typename T> __device__ T operator()(T x) {
    return static_cast<T>(1.f / (1.f + expf(-static_cast<float>(x))));
  }
};
}  // namespace mlx::core::cu
""",
    "mlx/backend/cuda/device/binary_ops.cuh": r"""
#pragma once
namespace mlx::core::cu {
struct Multiply {
  template <typename T> __device__ T operator()(T x, T y) { return x * y; }
};
}  // namespace mlx::core::cu
""",
}

_CUDA_TYPES = {"bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
               "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
               "float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}


def _package_dir(name: str) -> Path | None:
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    paths = list(getattr(module, "__path__", []))
    return Path(paths[0]) if paths else None


def _locations() -> tuple[Path, list[Path]] | None:
    nvrtc, runtime, cccl = (_package_dir(f"nvidia.{n}") for n in ("cuda_nvrtc", "cuda_runtime", "cuda_cccl"))
    if nvrtc is None or runtime is None or cccl is None:
        return None
    libs = sorted((nvrtc / "lib").glob("libnvrtc.so*"))
    if not libs:
        return None
    return libs[0], [runtime / "include", cccl / "include"]


def available() -> bool:
    """Whether NVRTC and the CUDA headers are installed (the test extras on Linux)."""
    return _locations() is not None


def cuda_type(dtype: Any) -> str:
    """The CUDA type MLX names a dtype (or its name) by in a kernel's signature."""
    return _CUDA_TYPES[str(dtype).split(".")[-1]]


def wrap(name: str, source: str, header: str, inputs: Sequence[tuple[str, str]], outputs: Sequence[tuple[str, str]],
         template: Sequence[tuple[str, Any]]) -> str:
    """The translation unit MLX builds for a kernel: `inputs` / `outputs` as (name, dtype or its name),
    every input taken as an array of at least one dimension; `template` values ints, bools or dtypes."""
    args = []
    for arg, kind in inputs:
        args.append(f"    const {cuda_type(kind)}* {arg}")
        for suffix, kind_of in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
            if arg + suffix in source:
                args.append(f"    const __grid_constant__ {kind_of} {arg}{suffix}")
    args += [f"    {cuda_type(kind)}* {arg}" for arg, kind in outputs]
    constants = []
    for key, value in template:
        if isinstance(value, bool):
            constants.append(f"  constexpr bool {key} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            constants.append(f"  constexpr int {key} = {value};")
        else:
            constants.append(f"  using {key} = {cuda_type(value)};")
    return (DEVICE_HEADER + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            f"__global__ void {name}(\n" + ",\n".join(args) + ") {\n" + "\n".join(constants) + "\n" + source
            + "\n}\n\n}  // namespace mlx::core::cu\n")


def compile_source(unit: str, name: str = "kernel") -> str | None:
    """None where NVRTC compiles `unit` for ARCH; else its log."""
    found = _locations()
    if found is None:
        raise RuntimeError("NVRTC is not installed (nvidia-cuda-nvrtc-cu12 and the CUDA header wheels)")
    lib_path, includes = found
    nvrtc = ctypes.CDLL(str(lib_path))
    program = ctypes.c_void_p()
    headers = (ctypes.c_char_p * len(MLX_HEADERS))(*(text.encode() for text in MLX_HEADERS.values()))
    names = (ctypes.c_char_p * len(MLX_HEADERS))(*(key.encode() for key in MLX_HEADERS))
    if nvrtc.nvrtcCreateProgram(ctypes.byref(program), unit.encode(), f"{name}.cu".encode(), len(MLX_HEADERS),
                                headers, names) != 0:
        return "nvrtcCreateProgram failed"
    try:
        options = [f"--gpu-architecture={ARCH}".encode(), b"--std=c++17",
                   *(b"-I" + str(path).encode() for path in includes)]
        array = (ctypes.c_char_p * len(options))(*options)
        status = nvrtc.nvrtcCompileProgram(program, len(options), array)
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        return None if status == 0 else log.value.decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
