"""The binding layer: MLX through mlx-c, in the shape of `mlx.core`."""
from __future__ import annotations

from . import (
    distributed as distributed,
    fast as fast,
    fft as fft,
    linalg as linalg,
    operators as _operators,  # noqa: F401  (attaches Array operators)
    random as random,
)

# Re-exports spelled `name as name` so that type checkers (mypy --strict: no implicit re-export) and
# linters see them as this package's public names; `from .ops import *` re-exports by itself.
from ._loader import MLXError as MLXError, check as check, ffi as ffi, lib as lib, mlx_c_version as mlx_c_version
from .array import Array as Array, FreedArrayError as FreedArrayError, asarray as asarray, to_numpy as to_numpy
from .device import (
    Device as Device,
    Stream as Stream,
    cpu as cpu,
    default_device as default_device,
    default_stream as default_stream,
    device_count as device_count,
    gpu as gpu,
    is_available as is_available,
    new_stream as new_stream,
    set_default_device as set_default_device,
    stream_scope as stream_scope,
    synchronize as synchronize,
)
from .dtypes import (
    Dtype as Dtype,
    bfloat16 as bfloat16,
    bool_ as bool_,
    complex64 as complex64,
    float16 as float16,
    float32 as float32,
    float64 as float64,
    int8 as int8,
    int16 as int16,
    int32 as int32,
    int64 as int64,
    uint8 as uint8,
    uint16 as uint16,
    uint32 as uint32,
    uint64 as uint64,
)
from .eval import async_eval as async_eval, eval as eval  # noqa: A004
from .io import (
    load as load,
    load_gguf as load_gguf,
    load_safetensors as load_safetensors,
    save_safetensors as save_safetensors,
)
from .memory import (
    clear_cache as clear_cache,
    cuda_available as cuda_available,
    device_info as device_info,
    get_active_memory as get_active_memory,
    get_cache_memory as get_cache_memory,
    get_memory_limit as get_memory_limit,
    get_peak_memory as get_peak_memory,
    metal_available as metal_available,
    reset_peak_memory as reset_peak_memory,
    set_cache_limit as set_cache_limit,
    set_memory_limit as set_memory_limit,
    set_wired_limit as set_wired_limit,
)
from .ops import *  # noqa: F403
from .ops import array as array, astype as astype
from .transforms import (  # noqa: A004
    checkpoint as checkpoint,
    compile as compile,
    grad as grad,
    jvp as jvp,
    set_compile_mode as set_compile_mode,
    value_and_grad as value_and_grad,
    vjp as vjp,
)

bool = bool_  # noqa: A001  (an alias; mlx.core spells it `bool_`, which is here too)
