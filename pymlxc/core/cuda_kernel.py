"""`mx.fast.cuda_kernel`: a custom CUDA kernel as an MLX operation (MLX's CUDA build only).

MLX compiles the source with NVRTC the first time the kernel runs with a given set of template
arguments, then keeps it. The source is the kernel's body: MLX writes the signature, one `const T*`
per input (plus `<name>_shape` / `<name>_strides` / `<name>_ndim` when the body uses them) and one
`T*` per output, and declares each template argument as a `constexpr` (ints, bools) or a type
alias (dtypes). `grid` counts threads, as in `mx.fast.metal_kernel`: the launch has
ceil(grid / threadgroup) blocks per axis.

The operation takes part in `mx.compile` traces like any other. Applying it on a machine without
CUDA raises an MLXError (MLX's own message), never crashes.
"""
from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

from . import dtypes as _dt
from ._gen import new_vector, unpack_vector, vector_of
from ._loader import MLXError, check, ffi, last_error, lib
from .array import Array
from .device import default_stream, resolve_stream

TemplateValue = int | bool | _dt.Dtype


def _strings(values: Sequence[str]) -> Any:
    keep = [ffi.new("char[]", v.encode()) for v in values]
    vec = lib.mlx_vector_string_new_data(ffi.new("const char *[]", keep), len(keep))
    return vec


def float32_bits(x: float) -> int:
    """`x` rounded to float32, as the signed int of its bits: a float constant as a template argument
    (which takes ints), read back in the kernel with `__int_as_float`."""
    return int.from_bytes(struct.pack("<f", x), "little", signed=True)


def mlx_kernel_name(name: str, source: str, header: str = "") -> str:
    """The name MLX gets for a kernel: `name` and a hash of its source. MLX keeps a kernel's
    compiled PTX on disk (MLX_PTX_CACHE_DIR, else /tmp/mlx/<version>/ptx) under its name and
    template arguments alone and loads it back by that name in later processes; with the source in
    the name, an edited kernel is compiled again instead of running the old binary."""
    return f"{name}_{hashlib.sha256((header + chr(0) + source).encode()).hexdigest()[:16]}"


class FastKernel:
    """What `CudaKernel` and the Metal backend's `MetalKernel` share: mlx-c has the same kernel
    calls under two prefixes, `mlx_fast_cuda_kernel_*` and `mlx_fast_metal_kernel_*`; a subclass
    names its prefix in `api` and its label for messages in `label`."""

    api: ClassVar[str]
    label: ClassVar[str]
    # Launch configurations kept per kernel, by output shapes, dtypes, grid, threadgroup, template
    # and init value: a prefill chunk op by op applies a kernel about ten times a layer with the same
    # few configurations, and building one costs a dozen mlx-c calls. Past this many, a call's
    # configuration is built and freed with it.
    MAX_CONFIGS: ClassVar[int] = 256

    def __init__(self, name: str, mlx_name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str, ensure_row_contiguous: bool, last_arg: int | bool) -> None:
        """`last_arg`: mlx-c's last argument of `..._kernel_new`, shared memory bytes (CUDA) or
        atomic outputs (Metal)."""
        self._h: Any = None
        self._configs: dict[tuple[Any, ...], Any] = {}
        self._lock = threading.Lock()
        if not output_names:
            raise ValueError(f"a {self.label} kernel needs at least one output")
        for n in (*input_names, *output_names):
            if not n.isidentifier():
                raise ValueError(f"kernel argument name {n!r} is not an identifier")
        self.name = name
        self.mlx_name = mlx_name
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        # Resolved once here, not on every call: kernels are applied on the decode path.
        self._c = {op: getattr(lib, f"mlx_fast_{self.api}_kernel_{op}") for op in _OPS}
        ins, outs = _strings(self.input_names), _strings(self.output_names)
        try:
            self._h = self._c["new"](mlx_name.encode(), ins, outs, source.encode(), header.encode(),
                                     bool(ensure_row_contiguous), last_arg)
        finally:
            lib.mlx_vector_string_free(ins)
            lib.mlx_vector_string_free(outs)
        if self._h.ctx == ffi.NULL:
            self._h = None
            raise MLXError(f"could not create {self.label} kernel {name!r}: {last_error()}")

    def _apply(self, inputs: Sequence[Array], output_shapes: Sequence[Sequence[int]],
               output_dtypes: Sequence[Any], grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
               template: Sequence[tuple[str, TemplateValue]], init_value: float | None, stream: Any) -> list[Array]:
        """Apply the kernel on `stream` (a stream or device; None: the default stream)."""
        if self._h is None:
            raise MLXError(f"{self.label} kernel {self.name!r} was closed")
        if len(inputs) != len(self.input_names):
            raise ValueError(f"kernel {self.name!r} takes {len(self.input_names)} inputs "
                             f"({', '.join(self.input_names)}), got {len(inputs)}")
        if len(output_shapes) != len(self.output_names) or len(output_dtypes) != len(self.output_names):
            raise ValueError(f"kernel {self.name!r} has {len(self.output_names)} outputs; give as many "
                             "output_shapes and output_dtypes")
        shapes = tuple(tuple(int(d) for d in shape) for shape in output_shapes)
        dtypes = tuple(_dt.as_dtype(d).value for d in output_dtypes)
        grid = (int(grid[0]), int(grid[1]), int(grid[2]))
        threadgroup = (int(threadgroup[0]), int(threadgroup[1]), int(threadgroup[2]))
        # The value's type is part of the key: True == 1, but a bool and an int argument differ.
        key = (shapes, dtypes, grid, threadgroup, tuple((k, type(v), v) for k, v in template), init_value)
        config = self._configs.get(key)
        kept = config is not None
        if config is None:
            config = self._config(shapes, dtypes, grid, threadgroup, template, init_value)
            with self._lock:
                if self._h is not None and len(self._configs) < self.MAX_CONFIGS and key not in self._configs:
                    self._configs[key] = config
                    kept = True
        try:
            _keep, vec = vector_of(inputs)
            out = new_vector()
            s = default_stream()._c if stream is None else ffi.new("mlx_stream *", [resolve_stream(stream)])[0]
            check(self._c["apply"](out, self._h, vec[0], config, s))
            return unpack_vector(out[0])
        finally:
            if not kept:
                self._c["config_free"](config)

    def _config(self, output_shapes: tuple[tuple[int, ...], ...], output_dtypes: tuple[int, ...],
                grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                template: Sequence[tuple[str, TemplateValue]], init_value: float | None) -> Any:
        """A new mlx-c launch configuration (the caller frees it, or keeps it in `_configs`)."""
        c = self._c
        config = c["config_new"]()
        try:
            for dims, dtype in zip(output_shapes, output_dtypes, strict=True):  # lengths checked by _apply
                check(c["config_add_output_arg"](config, ffi.new("int[]", list(dims)), len(dims), dtype))
            check(c["config_set_grid"](config, *grid))
            check(c["config_set_thread_group"](config, *threadgroup))
            for key, value in template:
                name = key.encode()
                if isinstance(value, bool):
                    check(c["config_add_template_arg_bool"](config, name, value))
                elif isinstance(value, int):
                    check(c["config_add_template_arg_int"](config, name, value))
                else:
                    check(c["config_add_template_arg_dtype"](config, name, _dt.as_dtype(value).value))
            if init_value is not None:
                check(c["config_set_init_value"](config, float(init_value)))
        except BaseException:
            c["config_free"](config)
            raise
        return config

    def close(self) -> None:
        with self._lock:
            h, self._h = self._h, None
            configs, self._configs = list(self._configs.values()), {}
        if lib is not None:
            for config in configs:
                self._c["config_free"](config)
            if h is not None:
                self._c["free"](h)

    def __del__(self) -> None:
        self.close()


# The `mlx_fast_<api>_kernel_<op>` calls a FastKernel makes.
_OPS = ("new", "free", "apply", "config_new", "config_free", "config_add_output_arg", "config_set_grid",
        "config_set_thread_group", "config_add_template_arg_bool", "config_add_template_arg_int",
        "config_add_template_arg_dtype", "config_set_init_value")


class CudaKernel(FastKernel):
    """A named kernel body with its input and output names; call it to apply it to arrays."""

    api = "cuda"
    label = "CUDA"

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True, shared_memory: int = 0) -> None:
        super().__init__(name, mlx_kernel_name(name, source, header), input_names, output_names, source, header,
                         ensure_row_contiguous, int(shared_memory))

    def __call__(self, inputs: Sequence[Array], *, output_shapes: Sequence[Sequence[int]],
                 output_dtypes: Sequence[Any], grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                 template: Sequence[tuple[str, TemplateValue]] = (), init_value: float | None = None,
                 stream: Any = None) -> list[Array]:
        return self._apply(inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value, stream)


def cuda_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                header: str = "", ensure_row_contiguous: bool = True, shared_memory: int = 0) -> CudaKernel:
    """A custom CUDA kernel (see the module docstring); `mx.cuda_available()` says whether it can run."""
    return CudaKernel(name, input_names, output_names, source, header, ensure_row_contiguous, shared_memory)


class SharedKernel:
    """A kernel made on first use and kept for the process: calling it returns the one
    `CudaKernel` (MLX compiles it once per set of template arguments). Thread-safe."""

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True) -> None:
        self._args = (name, tuple(input_names), tuple(output_names), source, header, ensure_row_contiguous)
        self._lock = threading.Lock()
        self._kernel: CudaKernel | None = None

    def __call__(self) -> CudaKernel:
        with self._lock:
            if self._kernel is None:
                self._kernel = cuda_kernel(*self._args)
            return self._kernel


__all__ = ["CudaKernel", "FastKernel", "SharedKernel", "cuda_kernel"]
