"""`mx.fast.metal_kernel` for pymlxc: a custom Metal kernel as an MLX operation (Apple GPUs only).

pymlxc.core exposes `cuda_kernel`; mlx-c has the Metal twin with the same configuration calls, so
this wrapper mirrors `pymlxc.core.cuda_kernel.CudaKernel` on `mlx_fast_metal_kernel_*`. MLX writes
the signature (`device const T* <input>`, `<input>_shape` ... when the body names them, `device T*
<output>`, and the `[[thread_position_in_grid]]`-style attributes the body uses) and compiles the
body the first time it runs with a set of template arguments. Applying it where Metal is missing
raises an MLXError with MLX's message.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from pymlxc.core import dtypes as _dt
from pymlxc.core._gen import new_vector, unpack_vector, vector_of
from pymlxc.core._loader import MLXError, check, ffi, last_error, lib
from pymlxc.core.array import Array
from pymlxc.core.device import default_stream

TemplateValue = int | bool | _dt.Dtype


def _strings(values: Sequence[str]) -> Any:
    keep = [ffi.new("char[]", v.encode()) for v in values]
    return lib.mlx_vector_string_new_data(ffi.new("const char *[]", keep), len(keep))


class MetalKernel:
    """A named Metal kernel body with its input and output names; call it to apply it to arrays."""

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True) -> None:
        self._h: Any = None
        if not output_names:
            raise ValueError("a Metal kernel needs at least one output")
        for n in (*input_names, *output_names):
            if not n.isidentifier():
                raise ValueError(f"kernel argument name {n!r} is not an identifier")
        self.name = name
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        ins, outs = _strings(self.input_names), _strings(self.output_names)
        try:
            self._h = lib.mlx_fast_metal_kernel_new(name.encode(), ins, outs, source.encode(), header.encode(),
                                                    bool(ensure_row_contiguous), False)
        finally:
            lib.mlx_vector_string_free(ins)
            lib.mlx_vector_string_free(outs)
        if self._h.ctx == ffi.NULL:
            self._h = None
            raise MLXError(f"could not create Metal kernel {name!r}: {last_error()}")

    def __call__(self, inputs: Sequence[Array], *, output_shapes: Sequence[Sequence[int]],
                 output_dtypes: Sequence[Any], grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                 template: Sequence[tuple[str, TemplateValue]] = ()) -> list[Array]:
        if self._h is None:
            raise MLXError(f"Metal kernel {self.name!r} was closed")
        if len(inputs) != len(self.input_names):
            raise ValueError(f"kernel {self.name!r} takes {len(self.input_names)} inputs "
                             f"({', '.join(self.input_names)}), got {len(inputs)}")
        if len(output_shapes) != len(self.output_names) or len(output_dtypes) != len(self.output_names):
            raise ValueError(f"kernel {self.name!r} has {len(self.output_names)} outputs; give as many "
                             "output_shapes and output_dtypes")
        config = lib.mlx_fast_metal_kernel_config_new()
        try:
            for shape, dtype in zip(output_shapes, output_dtypes, strict=True):
                dims = [int(d) for d in shape]
                check(lib.mlx_fast_metal_kernel_config_add_output_arg(
                    config, ffi.new("int[]", dims), len(dims), _dt.as_dtype(dtype).value))
            check(lib.mlx_fast_metal_kernel_config_set_grid(config, *(int(g) for g in grid)))
            check(lib.mlx_fast_metal_kernel_config_set_thread_group(config, *(int(t) for t in threadgroup)))
            for key, value in template:
                name = key.encode()
                if isinstance(value, bool):
                    check(lib.mlx_fast_metal_kernel_config_add_template_arg_bool(config, name, value))
                elif isinstance(value, int):
                    check(lib.mlx_fast_metal_kernel_config_add_template_arg_int(config, name, value))
                else:
                    check(lib.mlx_fast_metal_kernel_config_add_template_arg_dtype(
                        config, name, _dt.as_dtype(value).value))
            _keep, vec = vector_of(inputs)
            out = new_vector()
            check(lib.mlx_fast_metal_kernel_apply(out, self._h, vec[0], config, default_stream()._c))
            return unpack_vector(out[0])
        finally:
            lib.mlx_fast_metal_kernel_config_free(config)

    def close(self) -> None:
        h, self._h = self._h, None
        if h is not None and lib is not None:
            lib.mlx_fast_metal_kernel_free(h)

    def __del__(self) -> None:
        self.close()


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


__all__ = ["MetalKernel", "SharedMetalKernel"]
