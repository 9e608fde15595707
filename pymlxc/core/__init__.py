"""The binding layer: MLX through mlx-c, in the shape of `mlx.core`."""
from __future__ import annotations

from ._loader import MLXError, check, ffi, lib, mlx_c_version
from .array import Array, FreedArrayError, asarray, to_numpy
from .device import (
    Device, Stream, cpu, default_device, default_stream, device_count, gpu, is_available, new_stream,
    set_default_device, stream_scope, synchronize,
)
from .dtypes import (
    Dtype, bfloat16, bool_, complex64, float16, float32, float64, int8, int16, int32, int64, uint8, uint16,
    uint32, uint64,
)
from . import operators as _operators  # noqa: F401  (attaches Array operators)
from .ops import *  # noqa: F401,F403
from .ops import array, astype
from .eval import async_eval, eval  # noqa: A004
from . import distributed, fast, fft, linalg, random  # noqa: F401
from .memory import (
    clear_cache, cuda_available, device_info, get_active_memory, get_cache_memory, get_memory_limit,
    get_peak_memory, metal_available, reset_peak_memory, set_cache_limit, set_memory_limit, set_wired_limit,
)
from .transforms import checkpoint, compile, grad, jvp, set_compile_mode, value_and_grad, vjp  # noqa: A004
from .io import load, load_gguf, load_safetensors, save_safetensors

bool = bool_  # noqa: A001  (an alias; mlx.core spells it `bool_`, which is here too)
