"""The binding layer: MLX through mlx-c, in the shape of `mlx.core`."""
from __future__ import annotations

# Re-exports spelled `name as name` so that type checkers (mypy --strict: no implicit re-export) and
# linters see them as this package's public names; `from .ops import *` re-exports by itself (its
# generated wrappers as declared in _generated.pyi). The explicit imports of a name that `ops` also has
# win whatever the order: ops leaves out `load` (io.load), and its Array/asarray are these.
from . import distributed as distributed
from . import fast as fast
from . import fft as fft
from . import linalg as linalg
from . import operators as _operators  # noqa: F401  (attaches Array operators)
from . import random as random
from ._loader import MLXError as MLXError
from ._loader import check as check
from ._loader import ffi as ffi
from ._loader import lib as lib
from ._loader import mlx_c_version as mlx_c_version
from .array import Array as Array
from .array import FreedArrayError as FreedArrayError
from .array import asarray as asarray
from .array import to_numpy as to_numpy
from .device import Device as Device
from .device import Stream as Stream
from .device import cpu as cpu
from .device import default_device as default_device
from .device import default_stream as default_stream
from .device import device_count as device_count
from .device import gpu as gpu
from .device import is_available as is_available
from .device import new_stream as new_stream
from .device import set_default_device as set_default_device
from .device import stream_scope as stream_scope
from .device import synchronize as synchronize
from .dtypes import Dtype as Dtype
from .dtypes import bfloat16 as bfloat16
from .dtypes import bool_ as bool_
from .dtypes import complex64 as complex64
from .dtypes import float16 as float16
from .dtypes import float32 as float32
from .dtypes import float64 as float64
from .dtypes import int8 as int8
from .dtypes import int16 as int16
from .dtypes import int32 as int32
from .dtypes import int64 as int64
from .dtypes import uint8 as uint8
from .dtypes import uint16 as uint16
from .dtypes import uint32 as uint32
from .dtypes import uint64 as uint64
from .eval import async_eval as async_eval  # noqa: A004
from .eval import eval as eval  # noqa: A004
from .io import load as load
from .io import load_gguf as load_gguf
from .io import load_safetensors as load_safetensors
from .io import save_safetensors as save_safetensors
from .memory import clear_cache as clear_cache
from .memory import cuda_available as cuda_available
from .memory import device_info as device_info
from .memory import get_active_memory as get_active_memory
from .memory import get_cache_memory as get_cache_memory
from .memory import get_memory_limit as get_memory_limit
from .memory import get_peak_memory as get_peak_memory
from .memory import metal_available as metal_available
from .memory import reset_peak_memory as reset_peak_memory
from .memory import set_cache_limit as set_cache_limit
from .memory import set_memory_limit as set_memory_limit
from .memory import set_wired_limit as set_wired_limit
from .ops import *  # noqa: F403
from .ops import array as array
from .ops import astype as astype
from .transforms import checkpoint as checkpoint
from .transforms import compile as compile  # noqa: A004
from .transforms import grad as grad
from .transforms import jvp as jvp
from .transforms import set_compile_mode as set_compile_mode
from .transforms import value_and_grad as value_and_grad
from .transforms import vjp as vjp

bool = bool_  # noqa: A001  (an alias; mlx.core spells it `bool_`, which is here too)
